# Declarations of the native core. Bodies live in _core.pyx and the _*.pxi files it includes.

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libcpp.vector cimport vector
from libcpp.deque cimport deque
from libcpp.set cimport set
from libcpp.unordered_map cimport unordered_map
from posix.uio cimport iovec

from aio_datadist._sys cimport pthread_t, pthread_mutex_t, pthread_cond_t
from aio_datadist._drivers cimport (
    CUcontext, CUdevice, CUevent, CUresult, CUstream, CUdeviceptr, CUmemcpyAttributes,
    cuInit_t, cuGetErrorString_t, cuGetErrorName_t, cuDeviceGet_t, cuDeviceGetCount_t,
    cuDevicePrimaryCtxRetain_t, cuCtxPushCurrent_t, cuCtxPopCurrent_t, cuLaunchHostFunc_t,
    cuMemcpyBatchAsync_v1_t, cuMemcpyBatchAsync_v2_t, cuDevicePrimaryCtxRelease_t, cuStreamIsCapturing_t,
    cuDeviceGetAttribute_t, cuMemHostGetDevicePointer_t,
    cuEventCreate_t, cuEventRecord_t, cuEventQuery_t, cuEventDestroy_t,
    aclError, aclrtContext, aclrtLaunchCallback_t, aclrtSubscribeReport_t, aclrtUnSubscribeReport_t,
    aclrtProcessReport_t, aclrtGetCurrentContext_t, aclrtSetCurrentContext_t, aclGetRecentErrMsg_t,
)


cdef struct Record:
    uint64_t token
    int32_t status
    int64_t aux


cdef struct CopySeg:
    uint64_t dst
    uint64_t src
    uint64_t nbytes


cdef cppclass CopyJob:
    uint64_t token
    vector[CopySeg] segs
    uint64_t total
    int remaining
    bint cancelled
    bint stream  # written with streaming stores (``_stream_copy.pxd``): total >= the threshold at submit


cdef struct CopyChunk:
    CopyJob *job
    size_t begin
    size_t end


cdef cppclass IoJob:
    uint64_t token
    int fd
    bint is_send
    vector[iovec] iov
    size_t pos
    uint64_t moved
    uint64_t total
    char *gate  # a gated receive: its first segment is an answer header, checked before the rest
    uint64_t gate_id  # the request id the header must name
    uint64_t serial  # unique per engine: a cancel names the job by it, never by its (reusable) token


cdef cppclass FdState:
    deque[IoJob *] sends
    deque[IoJob *] recvs
    uint32_t interest


cdef struct IoCommand:
    int kind
    IoJob *job
    uint64_t token
    int fd
    uint64_t serial  # CMD_CANCEL: the job it cancels, if that job is still queued on fd


# Every native object that owns threads, or locks and fds its threads share, records the process that made it
# (``_made_by``: its fork generation, ``_generation`` in _core.pyx): in a forked child the parent's threads do not
# exist and a lock one of them held stays held, so there such an object is only let go of (closed without a join,
# a lock or a wake-up) and refuses work.

cdef class CompletionQueue:
    cdef int _made_by
    cdef int _efd
    cdef bint _closed
    cdef bint _counted
    cdef pthread_mutex_t _lock
    cdef vector[Record] _records
    cdef void push(self, uint64_t token, int32_t status, int64_t aux) noexcept nogil
    cdef _shutdown(self)
    cdef _check_open(self)


cdef class HostCopyEngine:
    cdef int _made_by
    cdef CompletionQueue _queue
    cdef pthread_mutex_t _lock
    cdef pthread_cond_t _cond
    cdef pthread_cond_t _over  # broadcast whenever a job leaves _jobs (see wait)
    cdef deque[CopyChunk] _chunks
    cdef unordered_map[uint64_t, CopyJob *] _jobs
    cdef vector[pthread_t] _threads
    cdef bint _stop
    cdef bint _closed
    cdef bint _counted
    cdef uint64_t _split_bytes
    cdef uint64_t _streamed  # jobs submitted to be written with streaming stores
    cdef void _work(self) noexcept nogil
    cdef void _split(self, CopyJob *job, uint64_t chunk_bytes) noexcept nogil
    cdef _shutdown(self)


cdef class SocketEngine:
    cdef int _made_by
    cdef CompletionQueue _queue
    cdef int _epfd
    cdef int _wakefd
    cdef pthread_t _thread
    cdef bint _started
    cdef bint _stop
    cdef bint _closed
    cdef bint _counted
    cdef pthread_mutex_t _lock
    cdef pthread_cond_t _acked
    cdef uint64_t _commands_sent
    cdef uint64_t _commands_done
    cdef uint64_t _serials
    cdef vector[IoCommand] _commands
    cdef unordered_map[int, FdState *] _fds
    cdef unordered_map[uint64_t, IoJob *] _jobs
    cdef void _run(self) noexcept nogil
    cdef void _apply(self, IoCommand cmd) noexcept nogil
    cdef void _progress(self, int fd, FdState *st, bint sending) noexcept nogil
    cdef void _fail_fd(self, int fd, FdState *st, int32_t status) noexcept nogil
    cdef void _update_interest(self, int fd, FdState *st) noexcept nogil
    cdef void _finish(self, IoJob *job, int32_t status) noexcept nogil
    cdef uint64_t _post(self, IoCommand cmd) noexcept nogil
    cdef uint64_t _enqueue(self, IoCommand cmd) noexcept nogil
    cdef _release_fds(self)
    cdef _shutdown(self)


# ---- StreamNotifier ----------------------------------------------------------------------

# Shared by a notifier and the host functions it has enqueued: the host
# function (run by a driver thread, without the GIL) finds its slot here,
# posts the record and frees the slot. The owner frees the state only once no
# slot is left, so a late host function never touches freed memory.
cdef cppclass NotifyState:
    pthread_mutex_t lock
    pthread_cond_t idle
    unordered_map[uint64_t, void *] slots  # tokens whose record is not posted yet
    size_t inflight  # host functions enqueued and not run yet (and notify calls not done): the state lives until none is left
    # Unposted slots only their host function will post, by notification number: the watcher posts a
    # slot early only if none notified before it is among them (the records of a notifier keep their order).
    set[uint64_t] behind
    uint64_t next_seq
    void *queue
    bint closed


cdef cppclass NotifySlot:
    NotifyState *state
    uint64_t token
    int64_t aux
    bint cancelled
    # Who still holds the slot: its host function, and the event watcher when it watches it (CUDA). The
    # record is posted once, by whichever sees the stream past it first; the last holder frees the slot.
    int refs
    bint posted
    bint behind  # listed in NotifyState.behind
    uint64_t seq  # notification number


# CUDA: a host function runs on the driver's callback thread some time after the stream reached it (on a
# VM, 250-350 us after a kernel ended). The watcher thread instead polls an event recorded just before
# the host function, for a short window, and posts the record as soon as the event completes; the host
# function stays the guarantee (it posts whatever the watcher did not).
cdef struct WatchItem:
    void *slot
    CUevent event
    int64_t deadline_ns


cdef cppclass EventWatch:
    pthread_mutex_t lock
    pthread_cond_t wake
    vector[WatchItem] items
    bint stop
    pthread_t thread
    int64_t poll_ns
    CUcontext ctx
    cuCtxPushCurrent_t ctx_push
    cuCtxPopCurrent_t ctx_pop
    cuEventQuery_t query
    cuEventDestroy_t destroy
    uint64_t early
    uint64_t expired


cdef class CudaDriver:
    cdef void *_lib
    cdef str _library
    cdef cuInit_t _init
    cdef cuGetErrorString_t _error_string
    cdef cuGetErrorName_t _error_name
    cdef cuDeviceGet_t _device_get
    cdef cuDeviceGetCount_t _device_count
    cdef cuDevicePrimaryCtxRetain_t _primary_retain
    cdef cuCtxPushCurrent_t _ctx_push
    cdef cuCtxPopCurrent_t _ctx_pop
    cdef cuLaunchHostFunc_t _launch_host_func
    cdef cuMemcpyBatchAsync_v2_t _batch_v2
    cdef cuMemcpyBatchAsync_v1_t _batch_v1
    cdef cuDevicePrimaryCtxRelease_t _primary_release
    cdef cuStreamIsCapturing_t _is_capturing
    cdef cuDeviceGetAttribute_t _device_attribute
    cdef cuMemHostGetDevicePointer_t _host_device_pointer
    cdef cuEventCreate_t _event_create
    cdef cuEventRecord_t _event_record
    cdef cuEventQuery_t _event_query
    cdef cuEventDestroy_t _event_destroy
    cdef dict _contexts
    cdef dict _retains
    cdef str _describe(self, CUresult rc)
    cdef CUevent _recorded_event(self, CUstream stream) noexcept nogil
    cdef CUcontext _retain(self, int device) except? NULL
    cdef void _release(self, int device)


cdef class AclDriver:
    cdef void *_lib
    cdef str _library
    cdef aclrtLaunchCallback_t _launch_callback
    cdef aclrtSubscribeReport_t _subscribe
    cdef aclrtUnSubscribeReport_t _unsubscribe
    cdef aclrtProcessReport_t _process_report
    cdef aclrtGetCurrentContext_t _get_context
    cdef aclrtSetCurrentContext_t _set_context
    cdef aclGetRecentErrMsg_t _recent_error
    cdef str _describe(self, aclError rc)


# One report thread per process and ACL runtime: a stream can be subscribed to
# one report thread only, so every notifier shares it. It sleeps on ``wake``
# while nothing is subscribed.
cdef class _AclReporter:
    cdef int _made_by
    cdef AclDriver _acl
    cdef aclrtContext _ctx
    cdef pthread_mutex_t _lock
    cdef pthread_cond_t _wake
    cdef pthread_t _thread
    cdef bint _started
    cdef bint _stop
    cdef unordered_map[uint64_t, int] _streams
    cdef uint64_t _rounds
    cdef void _loop(self) noexcept nogil
    cdef int _subscribe(self, uint64_t stream, aclrtContext ctx) except -1
    cdef void _unsubscribe(self, uint64_t stream, aclrtContext ctx) noexcept nogil

cdef class StreamNotifier:
    cdef int _made_by
    cdef CompletionQueue _queue
    cdef NotifyState *_state
    cdef EventWatch *_watch
    cdef int _backend
    cdef int _device
    cdef CudaDriver _cuda
    cdef CUcontext _ctx
    cdef bint _retained
    cdef AclDriver _acl
    cdef aclrtContext _acl_ctx
    cdef _AclReporter _reporter
    cdef vector[uint64_t] _subscribed
    cdef bint _closed
    cdef bint _counted
    cdef _prune(self)
    cdef bint _shutdown(self, double timeout_s)

# ---- the host backend's stream: an ordered native copy queue ----------------------------
cdef cppclass HostEvent:
    bint done
    int refs

cdef cppclass HostOp:
    int kind
    vector[CopySeg] segs
    void *slot
    HostEvent *event

cdef class HostStream:
    cdef int _made_by
    cdef pthread_mutex_t _lock
    cdef pthread_cond_t _cond
    cdef deque[HostOp *] _ops
    cdef pthread_t _thread
    cdef bint _started
    cdef bint _stop
    cdef bint _counted
    cdef uint64_t _enqueued
    cdef uint64_t _done
    cdef void _run(self) noexcept nogil
    cdef int _push(self, HostOp *op) except -1
    cdef _close(self)

cdef class _HostFnLine:
    cdef int _made_by
    cdef CompletionQueue _queue
    cdef NotifyState *_state
    cdef deque[NotifySlot *] _line
    cdef bint _counted
