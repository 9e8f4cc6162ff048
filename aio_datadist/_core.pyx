# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Native core of aio_datadist.

Three engines post ``(token, status, aux)`` records to a :class:`CompletionQueue`
whose eventfd the asyncio layer watches:

* :class:`HostCopyEngine` runs batched memcpy lists on worker threads.
* :class:`SocketEngine` runs scatter/gather ``writev``/``readv`` jobs on
  non-blocking sockets from one epoll thread.
* :class:`StreamNotifier` posts a record once a CUDA or Ascend stream has
  finished everything enqueued on it before (a driver host function, found
  with dlopen at run time: building needs no device toolkit).
* the segment builders turn base addresses and block indices into coalesced
  segment lists without a Python loop per block.

``status`` is 0 on success or a negative errno (``-ECANCELED`` for cancelled
work). ``aux`` is the number of bytes moved. Nothing here knows about asyncio.
"""

from cpython cimport array
from cython.operator cimport dereference as deref, preincrement as inc
from libc.errno cimport errno, EAGAIN, EINTR
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy
from libcpp.algorithm cimport sort as _sort
from libcpp.vector cimport vector
from posix.uio cimport iovec, readv, writev

from aio_datadist._stream_copy cimport aio_stream_copy
from aio_datadist._sys cimport (
    CLOCK_MONOTONIC, CLOCK_REALTIME, ECANCELED, ECONNRESET, EFD_CLOEXEC, EFD_NONBLOCK, EIO, ENODEV, EPOLL_CLOEXEC,
    EPOLL_CTL_ADD, EPOLL_CTL_DEL, EPOLL_CTL_MOD, EPOLLERR, EPOLLHUP, EPOLLIN, EPOLLOUT, ETIMEDOUT,
    IOV_MAX, RTLD_LOCAL, RTLD_NOW, clock_gettime, close, dlerror, dlopen, dlsym,
    epoll_create1, epoll_ctl, epoll_event, epoll_wait, eventfd, getpid, pthread_atfork,
    pthread_cond_broadcast, pthread_cond_destroy, pthread_cond_init,
    pthread_cond_signal, pthread_cond_timedwait, pthread_cond_wait, pthread_create, pthread_join,
    pthread_mutex_destroy, pthread_mutex_init, pthread_mutex_lock,
    pthread_mutex_unlock, pthread_t, read, sched_yield, setsockopt, SO_RCVLOWAT, SOL_SOCKET, timespec, write,
)
from aio_datadist._drivers cimport (
    ACL_CALLBACK_NO_BLOCK, ACL_SUCCESS, CU_MEMCPY_FLAG_DEFAULT, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
    CUDA_SUCCESS, aclError, aclrtContext, aclrtStream, CUcontext, CUdevice, CUdeviceptr,
    CUmemcpyAttributes, CUresult, CUstream, cuInit_t, cuGetErrorString_t, cuGetErrorName_t, cuDeviceGet_t,
    cuDeviceGetCount_t, cuDevicePrimaryCtxRetain_t, cuCtxPushCurrent_t, cuCtxPopCurrent_t, cuLaunchHostFunc_t,
    cuMemcpyBatchAsync_v1_t, cuMemcpyBatchAsync_v2_t, cuDevicePrimaryCtxRelease_t, cuStreamIsCapturing_t,
    cuDeviceGetAttribute_t, cuMemHostGetDevicePointer_t, CU_STREAM_CAPTURE_STATUS_NONE,
    CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, aclrtLaunchCallback_t, aclrtSubscribeReport_t,
    aclrtUnSubscribeReport_t, aclrtProcessReport_t, aclrtGetCurrentContext_t, aclrtSetCurrentContext_t,
    aclGetRecentErrMsg_t, CUevent, cuEventCreate_t, cuEventRecord_t, cuEventQuery_t, cuEventDestroy_t,
    CUDA_ERROR_NOT_READY, CU_EVENT_DISABLE_TIMING,
)
from cpython.ref cimport Py_INCREF
from libcpp.deque cimport deque

import array as _pyarray
import errno as _errno
import os as _os
import warnings as _warnings

OK = 0
CANCELLED = -ECANCELED
CONNECTION_LOST = -ECONNRESET

cdef array.array _U64 = _pyarray.array("Q")
cdef array.array _I64 = _pyarray.array("q")
cdef uint64_t _MIN_SPLIT = 1 << 20
#: The size of the answer header a gated receive starts with (``SocketEngine.submit_recv_gated``).
cdef uint64_t GATE_BYTES_C = 24
GATE_BYTES = GATE_BYTES_C
cdef uint64_t _CANCEL_STEP = 1 << 20
#: Host copies of at least this many bytes in all (a ``copy_now`` list, an engine job) write with streaming
#: stores (``_stream_copy.pxd``); ``set_stream_copy_min`` changes it.
cdef uint64_t _stream_min = 2 << 20
#: ``copy_now`` lists written with streaming stores so far (counted with the GIL held).
cdef uint64_t _streamed_lists = 0


cdef inline void _copy(void *dst, const void *src, size_t n, bint stream) noexcept nogil:
    if stream:
        aio_stream_copy(dst, src, n)
    else:
        memcpy(dst, src, n)


def stream_copy_min():
    """The size from which a host copy (``copy_now``'s list, a ``HostCopyEngine`` job, in all) writes with
    streaming stores that bypass the CPU caches."""
    return _stream_min


def streamed_lists():
    """How many ``copy_now`` lists were written with streaming stores in this process (for tests and
    benchmarks; an engine's jobs: ``HostCopyEngine.streamed_jobs``)."""
    return _streamed_lists


def set_stream_copy_min(nbytes):
    """Set :func:`stream_copy_min` (bytes, >= 0; 0: every copy; 2**64 - 1: none); the size it replaces. Jobs
    already submitted keep theirs."""
    global _stream_min
    if type(nbytes) is not int or not 0 <= nbytes < 2 ** 64:
        raise ValueError(f"the streaming copy threshold must be an int in [0, 2**64), got {nbytes!r}")
    old = _stream_min
    _stream_min = nbytes
    return old

_live = {"CompletionQueue": 0, "HostCopyEngine": 0, "SocketEngine": 0, "StreamNotifier": 0, "_HostFnLine": 0,
         "HostStream": 0}


def live_objects():
    """Return how many native objects of each kind are open (for leak checks)."""
    return dict(_live)


#: How many forks lie between the process that loaded the core and this one, counted up in a forked child
#: (``_after_fork_child``, in ``_host_stream.pxi``, which also re-makes ``_host_copy.pxi``'s close lock): an
#: object whose ``_made_by`` differs was made by an ancestor process, whose threads are not here. Not the process
#: id: a descendant may get a dead ancestor's id back.
cdef int _generation = 0
#: This process's id, for messages only.
cdef int _pid = getpid()


cdef extern from *:
    """
    #include <new>
    // Drop what a container holds without running its destructor (nor touching its memory): in a forked
    // child the parent's threads may have been changing it at the fork. What it held is leaked.
    template <class T> static inline void aio_forget(T &obj) { new (&obj) T(); }
    """
    void aio_forget[T](T &obj) noexcept nogil


cdef inline bint _foreign(int made_by) noexcept nogil:
    return made_by != _generation


cdef int _check_here(str what, int made_by) except -1:
    if made_by != _generation:
        raise RuntimeError(f"this {what} was made by a process this one was forked from (this is a forked child, "
                           f"process {_pid}), whose threads do not run here: it can only be closed or dropped here")
    return 0


cdef _uncount(str kind):
    # At interpreter exit the module's globals may already be None.
    if _live is not None:
        _live[kind] -= 1


cdef array.array _new_u64(Py_ssize_t n):
    return array.clone(_U64, n, zero=False)


# --------------------------------------------------------------------------
# The parts, one job each, included in the order they had when they were one file. Process-wide state lives
# above, except the engines' shared close lock (``_host_copy.pxi``) and the fork handler (``_host_stream.pxi``).

include "_completions.pxi"  # CompletionQueue: the records every engine posts, and the eventfd the loop watches
include "_host_copy.pxi"  # HostCopyEngine: batched memcpy lists on worker threads
include "_sockets.pxi"  # SocketEngine and LoopJob: scatter/gather socket jobs (epoll thread, or the loop)
include "_segments.pxi"  # Segment builders, copy_now, socket peeks and the ledger words
include "_device_drivers.pxi"  # Device drivers (CUDA, Ascend ACL), loaded at run time with dlopen
include "_stream_notifier.pxi"  # StreamNotifier: a record once a device stream reaches it
include "_host_stream.pxi"  # HostStream: the host backend's stream
