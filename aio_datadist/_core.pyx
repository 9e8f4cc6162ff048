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
#: (``_after_fork_child``): an object whose ``_made_by`` differs was made by an ancestor process, whose threads
#: are not here. Not the process id: a descendant may get a dead ancestor's id back.
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
# CompletionQueue


cdef class CompletionQueue:
    """An eventfd plus a thread-safe list of completion records.

    Native threads push records and make the fd readable; the owner reads
    them back with :meth:`drain`, which never blocks.
    """

    def __cinit__(self):
        # Until construction succeeds the object counts as closed, so that
        # __dealloc__ of a half-built object releases nothing it does not own.
        self._made_by = _generation
        self._efd = -1
        self._closed = True
        pthread_mutex_init(&self._lock, NULL)
        cdef int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        if efd < 0:
            err = errno
            raise OSError(err, _os.strerror(err))
        self._efd = efd
        self._closed = False
        self._counted = True
        _live["CompletionQueue"] += 1

    def __dealloc__(self):
        if self._counted:
            self._shutdown()
        if not _foreign(self._made_by):  # in a forked child a parent's thread may have held it: leaked
            pthread_mutex_destroy(&self._lock)

    def __del__(self):
        if self._counted and not _foreign(self._made_by):
            _warnings.warn("CompletionQueue was not closed", ResourceWarning, stacklevel=2)

    cdef void push(self, uint64_t token, int32_t status, int64_t aux) noexcept nogil:
        cdef Record rec
        cdef uint64_t one = 1
        rec.token = token
        rec.status = status
        rec.aux = aux
        if _foreign(self._made_by):
            return  # a parent's eventfd: a write here would wake the parent's reader
        pthread_mutex_lock(&self._lock)
        if self._closed:
            pthread_mutex_unlock(&self._lock)
            return
        self._records.push_back(rec)
        # Written under the lock: close() may otherwise close (and the OS
        # reuse) the fd between the check above and this write.
        write(self._efd, &one, 8)
        pthread_mutex_unlock(&self._lock)

    def fileno(self):
        """The eventfd that becomes readable when records are waiting."""
        self._check_open()
        return self._efd

    @property
    def closed(self):
        return self._closed

    def post(self, uint64_t token, int32_t status=0, int64_t aux=0):
        """Push a record from Python (used by Python-side work and tests)."""
        self._check_open()
        with nogil:
            self.push(token, status, aux)

    def drain(self):
        """Return every waiting record as a list of ``(token, status, aux)``."""
        cdef uint64_t counter
        cdef vector[Record] taken
        cdef size_t i
        self._check_open()
        with nogil:
            read(self._efd, &counter, 8)
            pthread_mutex_lock(&self._lock)
            taken.swap(self._records)
            pthread_mutex_unlock(&self._lock)
        return [(taken[i].token, taken[i].status, taken[i].aux) for i in range(taken.size())]

    def close(self):
        """Close the eventfd; records pushed afterwards are dropped. Idempotent."""
        if self._counted:
            self._shutdown()

    cdef _shutdown(self):
        if _foreign(self._made_by):
            # A forked child's copy: a parent's thread may have held the lock at the fork. Only this
            # process's descriptor of the eventfd goes (the parent's stays open); the records are left.
            self._closed = True
            if self._efd >= 0:
                close(self._efd)
                self._efd = -1
            aio_forget(self._records)
        else:
            pthread_mutex_lock(&self._lock)
            self._closed = True
            self._records.clear()
            if self._efd >= 0:
                close(self._efd)
                self._efd = -1
            pthread_mutex_unlock(&self._lock)
        if self._counted:
            self._counted = False
            _uncount("CompletionQueue")

    cdef _check_open(self):
        _check_here("CompletionQueue", self._made_by)
        if self._closed:
            raise ValueError("CompletionQueue is closed")


# --------------------------------------------------------------------------
# HostCopyEngine


cdef void *_copy_worker_main(void *arg) noexcept nogil:
    (<HostCopyEngine>arg)._work()
    return NULL


cdef void _deadline_in(timespec *deadline, long ms) noexcept nogil:
    # CLOCK_REALTIME now plus ``ms`` (a negative one counts as 0), for pthread_cond_timedwait: a tv_nsec
    # outside [0, 1e9) would make every wait fail with EINVAL at once.
    if ms < 0:
        ms = 0
    clock_gettime(CLOCK_REALTIME, deadline)
    deadline.tv_sec += ms // 1000
    deadline.tv_nsec += (ms % 1000) * 1000000
    if deadline.tv_nsec >= 1000000000:
        deadline.tv_sec += 1
        deadline.tv_nsec -= 1000000000


#: The longest wait in ms (about 35,000 years): what an infinite timeout comes to.
cdef long _FOREVER_MS = 1 << 50


cdef long _wait_ms(double timeout) noexcept nogil:
    # ``timeout`` seconds as ms for _deadline_in: a negative one has passed already, an infinite one has no
    # bound. NaN (refused by _check_timeout at the Python entry) counts as 0.
    if not timeout > 0:
        return 0
    if timeout >= _FOREVER_MS / 1000.0:
        return _FOREVER_MS
    return <long>(timeout * 1000)


# A close() that finds another one under way on the same object (from another thread) waits on this for it
# to finish, so that close() returns only once the object is closed; the one that closes marks it closed
# under the lock and broadcasts. Shared by every kind (closing is rare), made anew in a forked child.
cdef pthread_mutex_t _close_lock
cdef pthread_cond_t _close_cond
pthread_mutex_init(&_close_lock, NULL)
pthread_cond_init(&_close_cond, NULL)


cdef void _mark_closed(bint *closed, bint value) noexcept nogil:
    # Set an object's flag that says its close() finished, and wake the close() calls that wait for that.
    pthread_mutex_lock(&_close_lock)
    closed[0] = value
    pthread_cond_broadcast(&_close_cond)
    pthread_mutex_unlock(&_close_lock)


cdef void _wait_closed(bint *closed) noexcept nogil:
    # Until another thread's close() of the object marked it closed (_mark_closed).
    pthread_mutex_lock(&_close_lock)
    while not closed[0]:
        pthread_cond_wait(&_close_cond, &_close_lock)
    pthread_mutex_unlock(&_close_lock)


cdef int _check_timeout(double timeout) except -1:
    if timeout != timeout:
        raise ValueError("timeout must be a number of seconds, got nan")
    return 0


cdef class HostCopyEngine:
    """Worker threads that run batched host memcpy lists without the GIL.

    A job is a flat list of ``dst, src, nbytes`` triples. Adjacent triples are
    coalesced, and a large job is split into chunks run by several threads.
    Each job posts one record when its last chunk finishes.
    """

    def __cinit__(self, CompletionQueue queue not None, int threads=2,
                  uint64_t split_bytes=4 << 20):
        cdef int i
        cdef pthread_t tid
        self._made_by = _generation
        self._closed = True
        self._stop = False
        pthread_mutex_init(&self._lock, NULL)
        pthread_cond_init(&self._cond, NULL)
        pthread_cond_init(&self._over, NULL)
        if threads < 1 or threads > 64:
            raise ValueError("threads must be in [1, 64]")
        queue._check_open()
        self._queue = queue
        self._split_bytes = split_bytes if split_bytes >= _MIN_SPLIT else _MIN_SPLIT
        self._streamed = 0
        for i in range(threads):
            if pthread_create(&tid, NULL, _copy_worker_main, <void *>self) != 0:
                self._shutdown()
                raise OSError("could not start a copy thread")
            self._threads.push_back(tid)
        self._closed = False
        self._counted = True
        _live["HostCopyEngine"] += 1

    def __dealloc__(self):
        if self._counted:
            self._shutdown()
        if not _foreign(self._made_by):
            # In a forked child the parent's copy threads were waiting on these at the fork and never leave:
            # destroying them would wait forever. Leaked there.
            pthread_cond_destroy(&self._cond)
            pthread_cond_destroy(&self._over)
            pthread_mutex_destroy(&self._lock)

    def __del__(self):
        if self._counted and not _foreign(self._made_by):
            _warnings.warn("HostCopyEngine was not closed", ResourceWarning, stacklevel=2)

    @property
    def threads(self):
        return self._threads.size()

    @property
    def streamed_jobs(self):
        """How many jobs were submitted to be written with streaming stores (``stream_copy_min``)."""
        cdef uint64_t n
        pthread_mutex_lock(&self._lock)
        n = self._streamed
        pthread_mutex_unlock(&self._lock)
        return n

    def submit(self, uint64_t token, const uint64_t[::1] triples not None):
        """Queue a copy job; returns the number of bytes it will move.

        ``triples`` is flat ``[dst0, src0, n0, dst1, src1, n1, ...]``. The
        caller guarantees that every range is valid memory that stays alive
        until the job's record arrives.
        """
        cdef size_t n = triples.shape[0]
        cdef size_t i, nthreads, begin
        cdef uint64_t total = 0, chunk_bytes, acc, piece
        cdef CopySeg seg
        cdef CopyJob *job
        cdef CopyChunk chunk
        _check_here("HostCopyEngine", self._made_by)
        if n % 3 != 0:
            raise ValueError("triples must hold dst, src, nbytes triples")
        if self._closed or self._stop:
            raise ValueError("HostCopyEngine is closed")
        job = new CopyJob()
        job.token = token
        job.cancelled = False
        with nogil:
            i = 0
            while i < n:
                seg.dst = triples[i]
                seg.src = triples[i + 1]
                seg.nbytes = triples[i + 2]
                i += 3
                if seg.nbytes == 0:
                    continue
                total += seg.nbytes
                if (job.segs.size() > 0 and job.segs.back().dst + job.segs.back().nbytes == seg.dst
                        and job.segs.back().src + job.segs.back().nbytes == seg.src):
                    job.segs[job.segs.size() - 1].nbytes += seg.nbytes
                else:
                    job.segs.push_back(seg)
        job.total = total
        job.stream = total >= _stream_min
        pthread_mutex_lock(&self._lock)
        # Again, under the lock: a close() from another thread may have begun while the triples were read
        # without the GIL. Past _stop no copy thread would take the job (nor _threads count one).
        if self._stop or self._threads.size() == 0:
            pthread_mutex_unlock(&self._lock)
            del job
            raise ValueError("HostCopyEngine is closed")
        if self._jobs.count(token):
            pthread_mutex_unlock(&self._lock)
            del job
            raise ValueError(f"token {token} is already in use")
        nthreads = self._threads.size()
        # Several chunks per thread: a thread that loses its core does not hold up the whole job.
        chunk_bytes = total // (4 * nthreads) + 1
        if chunk_bytes < self._split_bytes:
            chunk_bytes = self._split_bytes
        self._jobs[token] = job
        if job.stream:
            self._streamed += 1
        job.remaining = 0
        if job.segs.size() == 0:
            chunk.job = job
            chunk.begin = 0
            chunk.end = 0
            self._chunks.push_back(chunk)
            job.remaining = 1
        else:
            self._split(job, chunk_bytes)
        pthread_mutex_unlock(&self._lock)
        pthread_cond_broadcast(&self._cond)
        return total

    cdef void _split(self, CopyJob *job, uint64_t chunk_bytes) noexcept nogil:
        # Cut oversized segments so each chunk holds about chunk_bytes.
        cdef vector[CopySeg] cut
        cdef CopySeg seg, part
        cdef size_t i, begin = 0
        cdef uint64_t acc = 0, room, take
        cdef CopyChunk chunk
        for i in range(job.segs.size()):
            seg = job.segs[i]
            while seg.nbytes > 0:
                room = chunk_bytes - acc
                take = seg.nbytes if seg.nbytes < room else room
                part.dst = seg.dst
                part.src = seg.src
                part.nbytes = take
                cut.push_back(part)
                seg.dst += take
                seg.src += take
                seg.nbytes -= take
                acc += take
                if acc >= chunk_bytes:
                    chunk.job = job
                    chunk.begin = begin
                    chunk.end = cut.size()
                    self._chunks.push_back(chunk)
                    job.remaining += 1
                    begin = cut.size()
                    acc = 0
        if begin < cut.size():
            chunk.job = job
            chunk.begin = begin
            chunk.end = cut.size()
            self._chunks.push_back(chunk)
            job.remaining += 1
        job.segs.swap(cut)

    def cancel(self, uint64_t token):
        """Cancel a queued or running job. Idempotent; True if it was pending.

        Its chunks not yet started leave the queue and a running chunk stops
        within 1 MiB; the job's record, posted once no thread works on the job
        any more (here and now when none did), then carries ``CANCELLED``. So
        the record of a job queued behind others does not wait for them.
        """
        cdef bint found = False
        cdef bint over = False
        cdef CopyJob *job = NULL
        cdef CopyChunk chunk
        cdef size_t i, n
        _check_here("HostCopyEngine", self._made_by)
        pthread_mutex_lock(&self._lock)
        it = self._jobs.find(token)
        if it != self._jobs.end():
            found = True
            job = deref(it).second
            if not job.cancelled:
                job.cancelled = True
                n = self._chunks.size()
                for i in range(n):  # one turn of the queue, the other jobs' chunks kept in order
                    chunk = self._chunks.front()
                    self._chunks.pop_front()
                    if chunk.job == job:
                        job.remaining -= 1
                    else:
                        self._chunks.push_back(chunk)
                if job.remaining == 0:
                    self._jobs.erase(it)
                    over = True
        pthread_mutex_unlock(&self._lock)
        if over:
            pthread_cond_broadcast(&self._over)
            self._queue.push(token, -ECANCELED, 0)
            del job
        return found

    def wait(self, uint64_t token, double timeout):
        """Block (without the GIL) until no copy thread works on job ``token`` any more, at most ``timeout``
        seconds; True once it is over (also for a token that names no job: over already, or never
        submitted), False if it still runs. Its record may still be on its way to the queue.

        With :meth:`cancel` first, a caller that must not return while the job may still write (its
        memory is released right after) waits about one ``_CANCEL_STEP`` (1 MiB) of copying.

        A negative ``timeout`` has passed already and an infinite one has no bound; NaN raises ValueError.
        """
        cdef timespec deadline
        cdef bint over
        _check_here("HostCopyEngine", self._made_by)
        _check_timeout(timeout)
        with nogil:
            _deadline_in(&deadline, _wait_ms(timeout))
            pthread_mutex_lock(&self._lock)
            while self._jobs.count(token):
                if pthread_cond_timedwait(&self._over, &self._lock, &deadline) != 0:
                    break  # ETIMEDOUT (any other error would come back at once every time)
            over = self._jobs.count(token) == 0
            pthread_mutex_unlock(&self._lock)
        return over

    def pending(self):
        """Number of jobs whose record has not been posted yet."""
        cdef size_t n
        _check_here("HostCopyEngine", self._made_by)
        pthread_mutex_lock(&self._lock)
        n = self._jobs.size()
        pthread_mutex_unlock(&self._lock)
        return n

    cdef void _work(self) noexcept nogil:
        cdef CopyChunk chunk
        cdef CopyJob *job
        cdef size_t i
        cdef bint skip, last
        cdef int32_t status
        cdef uint64_t done, step
        while True:
            pthread_mutex_lock(&self._lock)
            while self._chunks.empty() and not self._stop:
                pthread_cond_wait(&self._cond, &self._lock)
            if self._chunks.empty():
                pthread_mutex_unlock(&self._lock)
                return
            chunk = self._chunks.front()
            self._chunks.pop_front()
            job = chunk.job
            skip = job.cancelled
            pthread_mutex_unlock(&self._lock)
            if not skip:
                # At most _CANCEL_STEP bytes between looks at the cancel flag: a cancelled job stops fast.
                for i in range(chunk.begin, chunk.end):
                    done = 0
                    while done < job.segs[i].nbytes and not (<volatile bint>job.cancelled):
                        step = job.segs[i].nbytes - done
                        if step > _CANCEL_STEP:
                            step = _CANCEL_STEP
                        _copy(<void *>(job.segs[i].dst + done), <const void *>(job.segs[i].src + done), step,
                              job.stream)
                        done += step
            pthread_mutex_lock(&self._lock)
            job.remaining -= 1
            last = job.remaining == 0
            if last:
                self._jobs.erase(job.token)
            pthread_mutex_unlock(&self._lock)
            if last:
                pthread_cond_broadcast(&self._over)
                status = -ECANCELED if job.cancelled else 0
                self._queue.push(job.token, status, <int64_t>(0 if job.cancelled else job.total))
                del job

    def close(self):
        """Cancel every job (each still posts its record) and join the threads. Idempotent; a close() while
        another thread closes the engine returns once that one has finished."""
        if self._counted or (not self._closed and _foreign(self._made_by)):
            self._shutdown()
        elif not self._closed:
            with nogil:
                _wait_closed(&self._closed)

    cdef _shutdown(self):
        cdef size_t i
        # Claimed with the GIL held, before the join lets it go: a concurrent close() waits (see close)
        # instead of joining the threads a second time.
        if self._counted:
            self._counted = False
            _uncount("HostCopyEngine")
        if _foreign(self._made_by):
            # A forked child: the copy threads are the parent's (none to join here) and one may have held the
            # lock at the fork. The queued jobs are let go of, not freed: a parent's thread may have been
            # changing the containers.
            self._stop = True
            aio_forget(self._chunks)
            aio_forget(self._jobs)
        else:
            pthread_mutex_lock(&self._lock)
            self._stop = True
            it = self._jobs.begin()
            while it != self._jobs.end():
                deref(it).second.cancelled = True
                inc(it)
            pthread_mutex_unlock(&self._lock)
            pthread_cond_broadcast(&self._cond)
            with nogil:
                for i in range(self._threads.size()):
                    pthread_join(self._threads[i], NULL)
        self._threads.clear()
        _mark_closed(&self._closed, True)


# --------------------------------------------------------------------------
# SocketEngine

DEF CMD_SUBMIT = 1
DEF CMD_CANCEL = 2
DEF CMD_DETACH = 3
DEF CMD_STOP = 4
DEF MAX_EVENTS = 64


cdef void _consume(IoJob *job, ssize_t r) noexcept nogil:
    """Advance ``job`` past ``r`` bytes moved."""
    job.moved += r
    while r > 0:
        if <size_t>r >= job.iov[job.pos].iov_len:
            r -= job.iov[job.pos].iov_len
            job.iov[job.pos].iov_len = 0
            job.pos += 1
        else:
            job.iov[job.pos].iov_base = <char *>job.iov[job.pos].iov_base + r
            job.iov[job.pos].iov_len -= r
            r = 0


cdef int _step(IoJob *job, bint sending) noexcept nogil:
    """Move what the socket takes of ``job`` now: 1 the job is over (every byte, or a gated receive stopped
    after its header), 0 the socket would block, else -errno (-ECONNRESET: the peer closed)."""
    cdef int32_t gate_status
    cdef uint64_t gate_total, gate_id
    cdef ssize_t r
    cdef int cnt, err
    cdef size_t left
    while job.pos < job.iov.size():
        left = job.iov.size() - job.pos
        cnt = IOV_MAX if left > <size_t>IOV_MAX else <int>left
        if job.gate != NULL and job.pos == 0:
            cnt = 1  # the header alone: nothing past it is read before it is checked
        if sending:
            r = writev(job.fd, &job.iov[job.pos], cnt)
        else:
            r = readv(job.fd, &job.iov[job.pos], cnt)
        if r < 0:
            err = errno
            if err == EINTR:
                continue
            if err == EAGAIN:
                return 0
            return -err
        if r == 0 and not sending:
            return -ECONNRESET
        _consume(job, r)
        if job.gate != NULL and job.pos >= 1:
            memcpy(&gate_status, job.gate + 4, 4)
            memcpy(&gate_id, job.gate + 8, 8)
            memcpy(&gate_total, job.gate + 16, 8)
            if (memcmp(job.gate, b"AIOA", 4) != 0 or gate_status != 0 or gate_id != job.gate_id
                    or gate_total != job.total - GATE_BYTES_C):
                job.gate = NULL
                return 1  # refused, or not the answer we asked for: the job ends after its header
            job.gate = NULL
    return 1


cdef bint _fill_job(IoJob *job, const uint64_t[::1] pairs, bint gated, uint64_t gate_id) except 0:
    """Set ``job``'s segments from ``[addr, nbytes, ...]`` (adjacent runs merged, never into a gate's header)."""
    cdef size_t n = pairs.shape[0]
    cdef size_t i
    cdef iovec v
    if n % 2 != 0:
        raise ValueError("pairs must hold addr, nbytes pairs")
    job.pos = 0
    job.moved = 0
    job.total = 0
    job.gate = NULL
    job.serial = 0
    if gated:
        if n < 2 or pairs[1] != GATE_BYTES_C:
            raise ValueError(f"a gated receive starts with its {GATE_BYTES_C}-byte header")
        job.gate = <char *>pairs[0]
        job.gate_id = gate_id
    with nogil:
        i = 0
        while i < n:
            v.iov_base = <void *>pairs[i]
            v.iov_len = pairs[i + 1]
            i += 2
            if v.iov_len == 0:
                continue
            job.total += v.iov_len
            if (job.iov.size() > 0 and (job.gate == NULL or job.iov.size() > 1)
                    and <char *>job.iov.back().iov_base + job.iov.back().iov_len == <char *>v.iov_base):
                job.iov[job.iov.size() - 1].iov_len += v.iov_len
            else:
                job.iov.push_back(v)
    return 1


cdef class LoopJob:
    """A send or (gated) receive that the event loop drives itself, for small transfers.

    The loop calls :meth:`step` when the non-blocking socket is ready (and
    once at the start); each call moves what the socket takes now, without
    the GIL, and says whether the job is over. No thread is involved, so once
    the loop stops calling, nothing of the job touches memory any more. The
    same gate as ``SocketEngine.submit_recv_gated`` applies to a gated one.
    """

    cdef IoJob *_job
    cdef readonly bint sending
    cdef int _lowat  # the SO_RCVLOWAT this receive set on its socket while it waits (0: the socket's default)
    cdef int _lowat_max

    def __cinit__(self, int fd, bint send, const uint64_t[::1] pairs not None, uint64_t gate_id=0,
                  bint gated=False, int lowat_max=0):
        if fd < 0:
            raise ValueError("fd must be a valid descriptor")
        if send and gated:
            raise ValueError("only a receive is gated")
        if lowat_max < 0:
            raise ValueError("lowat_max must be >= 0")
        self._lowat = 0
        self._lowat_max = lowat_max
        self._job = new IoJob()
        self._job.fd = fd
        self._job.is_send = send
        self.sending = send
        _fill_job(self._job, pairs, gated, gate_id)

    def __dealloc__(self):
        if self._job != NULL:
            del self._job
            self._job = NULL

    def step(self):
        """Move what the socket takes now: 1 over, 0 it would block, else -errno.

        With ``lowat_max``, a receive that must wait for more of its bytes (its header checked, if
        gated) sets the socket's ``SO_RCVLOWAT`` to what is left, at most ``lowat_max``, so the loop
        sees the socket ready once that much can be read instead of at every segment that arrives (the
        kernel caps it by the receive buffer and still signals when the window closes, at the end of
        the stream or on an error); a job that ends puts the socket's default back."""
        cdef int rc
        cdef uint64_t left
        cdef int want
        with nogil:
            rc = _step(self._job, self.sending)
            if self._lowat_max and not self.sending:
                if rc == 0:
                    if self._job.gate == NULL:
                        left = self._job.total - self._job.moved
                        want = self._lowat_max if left > <uint64_t>self._lowat_max else <int>left
                        if want != self._lowat and (want > 1 or self._lowat):
                            if setsockopt(self._job.fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(int)) == 0:
                                self._lowat = want
                elif self._lowat:
                    self._reset_lowat()
        return rc

    cdef void _reset_lowat(self) noexcept nogil:
        cdef int one = 1
        setsockopt(self._job.fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof(int))
        self._lowat = 0

    def release(self):
        """Put back the socket's ``SO_RCVLOWAT`` if this job set it (for a job stopped before it ended; call
        it before the socket is closed)."""
        if self._lowat:
            self._reset_lowat()

    @property
    def moved(self):
        return self._job.moved

    @property
    def total(self):
        return self._job.total


cdef void *_io_main(void *arg) noexcept nogil:
    (<SocketEngine>arg)._run()
    return NULL


cdef class SocketEngine:
    """One epoll thread that moves scatter/gather lists over sockets.

    A job sends (``writev``) or receives (``readv``) an exact list of
    ``addr, nbytes`` segments on a non-blocking socket. Jobs on one fd and
    direction run in submission order. The Python side must not touch a
    socket's data while jobs are queued on it, and must :meth:`detach` an fd
    before closing it.
    """

    def __cinit__(self, CompletionQueue queue not None):
        self._made_by = _generation
        self._epfd = -1
        self._wakefd = -1
        self._closed = True
        self._stop = False
        self._started = False
        self._commands_sent = 0
        self._commands_done = 0
        self._serials = 0
        pthread_mutex_init(&self._lock, NULL)
        pthread_cond_init(&self._acked, NULL)
        queue._check_open()
        self._queue = queue
        self._epfd = epoll_create1(EPOLL_CLOEXEC)
        self._wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        cdef epoll_event ev
        ev.events = EPOLLIN
        ev.data.fd = self._wakefd
        if self._epfd < 0 or self._wakefd < 0 or epoll_ctl(self._epfd, EPOLL_CTL_ADD, self._wakefd, &ev) != 0:
            err = errno
            self._release_fds()
            raise OSError(err, _os.strerror(err))
        if pthread_create(&self._thread, NULL, _io_main, <void *>self) != 0:
            self._release_fds()
            raise OSError("could not start the socket thread")
        self._started = True
        self._closed = False
        self._counted = True
        _live["SocketEngine"] += 1

    def __dealloc__(self):
        if self._counted:
            self._shutdown()
        if not _foreign(self._made_by):  # in a forked child the parent's thread may hold or wait on them: leaked
            pthread_cond_destroy(&self._acked)
            pthread_mutex_destroy(&self._lock)

    def __del__(self):
        if self._counted and not _foreign(self._made_by):
            _warnings.warn("SocketEngine was not closed", ResourceWarning, stacklevel=2)

    cdef _release_fds(self):
        if self._epfd >= 0:
            close(self._epfd)
            self._epfd = -1
        if self._wakefd >= 0:
            close(self._wakefd)
            self._wakefd = -1

    cdef uint64_t _enqueue(self, IoCommand cmd) noexcept nogil:
        # With the lock held: queue a command for the engine thread (the caller wakes it); its ticket.
        self._commands.push_back(cmd)
        self._commands_sent += 1
        return self._commands_sent

    cdef uint64_t _post(self, IoCommand cmd) noexcept nogil:
        cdef uint64_t one = 1, ticket
        pthread_mutex_lock(&self._lock)
        ticket = self._enqueue(cmd)
        pthread_mutex_unlock(&self._lock)
        write(self._wakefd, &one, 8)
        return ticket

    def _submit(self, uint64_t token, int fd, bint is_send, const uint64_t[::1] pairs, bint gated=False,
                uint64_t gate_id=0):
        cdef IoJob *job
        cdef IoCommand cmd
        cdef uint64_t total, one = 1
        _check_here("SocketEngine", self._made_by)
        if fd < 0:
            raise ValueError("fd must be a valid descriptor")
        if self._closed:
            raise ValueError("SocketEngine is closed")
        job = new IoJob()
        job.token = token
        job.fd = fd
        job.is_send = is_send
        try:
            _fill_job(job, pairs, gated, gate_id)
        except BaseException:
            del job
            raise
        total = job.total  # read now: once posted, the engine thread may end and free the job at any time
        cmd.kind = CMD_SUBMIT
        cmd.job = job
        cmd.token = token
        cmd.fd = fd
        pthread_mutex_lock(&self._lock)
        # Again, under the lock: a close() from another thread may have posted its STOP while the pairs were
        # read without the GIL (it clears _started first, under this lock), or the thread may be gone (_stop).
        # A job queued behind the STOP would never be applied.
        if not self._started or self._stop:
            pthread_mutex_unlock(&self._lock)
            del job
            raise ValueError("SocketEngine is closed")
        if self._jobs.count(token):
            pthread_mutex_unlock(&self._lock)
            del job
            raise ValueError(f"token {token} is already in use")
        self._serials += 1
        job.serial = self._serials
        cmd.serial = job.serial
        self._jobs[token] = job
        # Queued under the same lock: a cancel that finds the job in _jobs is always applied after its submit.
        self._enqueue(cmd)
        pthread_mutex_unlock(&self._lock)
        write(self._wakefd, &one, 8)
        return total

    def submit_send(self, uint64_t token, int fd, const uint64_t[::1] pairs not None):
        """Queue a send of ``[addr0, n0, addr1, n1, ...]``; returns its byte count."""
        return self._submit(token, fd, True, pairs)

    def submit_recv(self, uint64_t token, int fd, const uint64_t[::1] pairs not None):
        """Queue a receive into ``[addr0, n0, addr1, n1, ...]``; returns its byte count."""
        return self._submit(token, fd, False, pairs)

    def submit_recv_gated(self, uint64_t token, int fd, const uint64_t[::1] pairs not None, uint64_t req_id):
        """Queue a receive whose first segment is a ``GATE_BYTES`` answer header.

        The header (``wire.ANSWER``: magic ``AIOA``, u32 status, u64 request
        id, u64 total, little-endian) is read alone first. Unless it has the
        magic, status 0, ``req_id`` and, as total, the size of the other
        segments, the job ends there, successfully, with ``aux`` = the
        header's size: nothing after the header is read, so no payload byte
        lands, and a refusal (whose text follows) leaves the byte stream in
        step. Otherwise the job goes on into the other segments. Returns the
        byte count.
        """
        return self._submit(token, fd, False, pairs, True, req_id)

    def cancel(self, uint64_t token):
        """Cancel a job; its record carries ``CANCELLED``. Idempotent.

        A job stopped after some bytes moved leaves the byte stream of its
        socket out of step: the caller must then drop that connection.
        """
        cdef IoCommand cmd
        cdef bint found = False
        cdef uint64_t one = 1
        _check_here("SocketEngine", self._made_by)
        if self._closed:
            return False
        pthread_mutex_lock(&self._lock)
        it = self._jobs.find(token)
        if it != self._jobs.end():
            # The command names this job by its serial: by the time the engine thread applies it the job may
            # have ended and its token named a new job, which the cancel must not touch.
            found = True
            cmd.kind = CMD_CANCEL
            cmd.job = NULL
            cmd.token = token
            cmd.fd = deref(it).second.fd
            cmd.serial = deref(it).second.serial
            self._enqueue(cmd)
        pthread_mutex_unlock(&self._lock)
        if found:
            write(self._wakefd, &one, 8)
        return found

    def detach(self, int fd):
        """Cancel every job on ``fd`` and forget it; returns once applied."""
        cdef IoCommand cmd
        cdef uint64_t ticket
        _check_here("SocketEngine", self._made_by)
        if self._closed:
            return
        cmd.kind = CMD_DETACH
        cmd.job = NULL
        cmd.token = 0
        cmd.fd = fd
        cmd.serial = 0
        with nogil:
            ticket = self._post(cmd)
            pthread_mutex_lock(&self._lock)
            while self._commands_done < ticket and not self._stop:
                pthread_cond_wait(&self._acked, &self._lock)
            pthread_mutex_unlock(&self._lock)

    def pending(self):
        """Number of jobs whose record has not been posted yet."""
        cdef size_t n
        _check_here("SocketEngine", self._made_by)
        pthread_mutex_lock(&self._lock)
        n = self._jobs.size()
        pthread_mutex_unlock(&self._lock)
        return n

    cdef void _finish(self, IoJob *job, int32_t status) noexcept nogil:
        pthread_mutex_lock(&self._lock)
        jt = self._jobs.find(job.token)
        if jt != self._jobs.end() and deref(jt).second == job:
            self._jobs.erase(jt)
        pthread_mutex_unlock(&self._lock)
        self._queue.push(job.token, status, <int64_t>job.moved)
        del job

    cdef void _update_interest(self, int fd, FdState *st) noexcept nogil:
        cdef epoll_event ev
        cdef uint32_t want = 0
        if not st.sends.empty():
            want |= EPOLLOUT
        if not st.recvs.empty():
            want |= EPOLLIN
        if want == st.interest:
            return
        ev.events = want
        ev.data.fd = fd
        if want == 0:
            epoll_ctl(self._epfd, EPOLL_CTL_DEL, fd, &ev)
        elif st.interest == 0:
            if epoll_ctl(self._epfd, EPOLL_CTL_ADD, fd, &ev) != 0:
                st.interest = 0
                self._fail_fd(fd, st, -errno)
                return
        else:
            epoll_ctl(self._epfd, EPOLL_CTL_MOD, fd, &ev)
        st.interest = want

    cdef void _fail_fd(self, int fd, FdState *st, int32_t status) noexcept nogil:
        cdef epoll_event ev
        while not st.sends.empty():
            self._finish(st.sends.front(), status)
            st.sends.pop_front()
        while not st.recvs.empty():
            self._finish(st.recvs.front(), status)
            st.recvs.pop_front()
        if st.interest != 0:
            epoll_ctl(self._epfd, EPOLL_CTL_DEL, fd, &ev)
            st.interest = 0

    cdef void _progress(self, int fd, FdState *st, bint sending) noexcept nogil:
        cdef IoJob *job
        cdef int rc
        while True:
            if sending:
                if st.sends.empty():
                    return
                job = st.sends.front()
            else:
                if st.recvs.empty():
                    return
                job = st.recvs.front()
            rc = _step(job, sending)
            if rc == 0:
                return
            if rc < 0:
                self._fail_fd(fd, st, rc)
                return
            if sending:
                st.sends.pop_front()
            else:
                st.recvs.pop_front()
            self._finish(job, 0)

    cdef void _apply(self, IoCommand cmd) noexcept nogil:
        cdef FdState *st
        cdef IoJob *job
        cdef size_t i
        if cmd.kind == CMD_SUBMIT:
            it = self._fds.find(cmd.fd)
            if it == self._fds.end():
                st = new FdState()
                st.interest = 0
                self._fds[cmd.fd] = st
            else:
                st = deref(it).second
            if cmd.job.total == 0:
                self._finish(cmd.job, 0)
                return
            if cmd.job.is_send:
                st.sends.push_back(cmd.job)
            else:
                st.recvs.push_back(cmd.job)
            self._update_interest(cmd.fd, st)
        elif cmd.kind == CMD_CANCEL:
            # Only the job with the command's serial, and only while it is queued on its fd: one that ended
            # (its token perhaps reused by a newer job already) or whose fd was detached is left alone.
            it = self._fds.find(cmd.fd)
            if it == self._fds.end():
                return
            st = deref(it).second
            job = NULL
            for i in range(st.sends.size()):
                if st.sends[i].serial == cmd.serial:
                    job = st.sends[i]
                    st.sends.erase(st.sends.begin() + i)
                    break
            if job == NULL:
                for i in range(st.recvs.size()):
                    if st.recvs[i].serial == cmd.serial:
                        job = st.recvs[i]
                        st.recvs.erase(st.recvs.begin() + i)
                        break
            if job == NULL:
                return
            self._finish(job, -ECANCELED)
            self._update_interest(cmd.fd, st)
        elif cmd.kind == CMD_DETACH:
            it = self._fds.find(cmd.fd)
            if it != self._fds.end():
                st = deref(it).second
                self._fail_fd(cmd.fd, st, -ECANCELED)
                self._fds.erase(cmd.fd)
                del st

    cdef void _run(self) noexcept nogil:
        cdef epoll_event events[MAX_EVENTS]
        cdef int n, i, fd
        cdef uint64_t counter
        cdef vector[IoCommand] cmds
        cdef size_t k
        cdef FdState *st
        cdef bint stop = False
        while not stop:
            n = epoll_wait(self._epfd, events, MAX_EVENTS, -1)
            if n < 0:
                if errno == EINTR:
                    continue
                break
            for i in range(n):
                fd = events[i].data.fd
                if fd == self._wakefd:
                    read(self._wakefd, &counter, 8)
                    pthread_mutex_lock(&self._lock)
                    cmds.swap(self._commands)
                    pthread_mutex_unlock(&self._lock)
                    for k in range(cmds.size()):
                        if cmds[k].kind == CMD_STOP:
                            stop = True
                        else:
                            self._apply(cmds[k])
                    pthread_mutex_lock(&self._lock)
                    self._commands_done += cmds.size()
                    pthread_mutex_unlock(&self._lock)
                    pthread_cond_broadcast(&self._acked)
                    cmds.clear()
                    continue
                it = self._fds.find(fd)
                if it == self._fds.end():
                    continue
                st = deref(it).second
                if events[i].events & (EPOLLOUT | EPOLLERR | EPOLLHUP):
                    self._progress(fd, st, True)
                if events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP):
                    self._progress(fd, st, False)
                self._update_interest(fd, st)
        # Shutting down: every job still queued ends as cancelled.
        it2 = self._fds.begin()
        while it2 != self._fds.end():
            st = deref(it2).second
            self._fail_fd(deref(it2).first, st, -ECANCELED)
            del st
            inc(it2)
        self._fds.clear()
        pthread_mutex_lock(&self._lock)
        self._stop = True  # from here on _submit refuses: no command is queued after this swap
        cmds.swap(self._commands)
        pthread_mutex_unlock(&self._lock)
        # Commands that came after the last swap (after the STOP, or after epoll_wait failed): a job among
        # them still ends with its record.
        for k in range(cmds.size()):
            if cmds[k].kind == CMD_SUBMIT:
                self._finish(cmds[k].job, -ECANCELED)
        pthread_mutex_lock(&self._lock)
        self._commands_done += cmds.size()
        pthread_mutex_unlock(&self._lock)
        pthread_cond_broadcast(&self._acked)

    def close(self):
        """Cancel every job (each still posts its record) and stop the thread. Idempotent; a close() while
        another thread closes the engine returns once that one has finished."""
        if self._counted or (not self._closed and _foreign(self._made_by)):
            self._shutdown()
        elif not self._closed:
            with nogil:
                _wait_closed(&self._closed)

    cdef _shutdown(self):
        cdef IoCommand cmd
        cdef uint64_t one = 1
        # Claimed with the GIL held, before the join lets it go: a concurrent close() waits (see close)
        # instead of posting a second STOP and joining the thread again.
        if self._counted:
            self._counted = False
            _uncount("SocketEngine")
        cmd.kind = CMD_STOP
        cmd.job = NULL
        cmd.token = 0
        cmd.fd = -1
        cmd.serial = 0
        if _foreign(self._made_by):
            # A forked child: the engine thread is the parent's (nothing to stop or join here), the wake
            # eventfd and the epoll set are shared with it, and it may have held the lock at the fork. Only
            # this process's descriptors go; the jobs and fd states are let go of, not freed.
            self._started = False
            aio_forget(self._commands)
            aio_forget(self._fds)
            aio_forget(self._jobs)
        elif self._started:
            with nogil:
                pthread_mutex_lock(&self._lock)
                self._started = False  # with the STOP, under the lock: _submit queues nothing behind it
                self._enqueue(cmd)
                pthread_mutex_unlock(&self._lock)
                write(self._wakefd, &one, 8)
                pthread_join(self._thread, NULL)
        self._release_fds()
        _mark_closed(&self._closed, True)


# --------------------------------------------------------------------------
# Segment builders


def segments(const uint64_t[::1] bases not None, const int64_t[::1] indices not None,
             uint64_t stride, uint64_t offset, uint64_t nbytes):
    """Coalesced ``[addr, nbytes, ...]`` pairs for every (tensor, index).

    The byte order is tensor-major, then index order:
    ``bases[t] + indices[i] * stride + offset`` for ``nbytes`` bytes.
    Callers validate indices and bounds first.
    """
    cdef size_t nt = bases.shape[0], ni = indices.shape[0]
    cdef array.array out = _new_u64(2 * nt * ni)
    cdef uint64_t *o = <uint64_t *>out.data.as_ulonglongs
    cdef size_t t, i, k = 0
    cdef uint64_t addr
    with nogil:
        for t in range(nt):
            for i in range(ni):
                addr = bases[t] + <uint64_t>indices[i] * stride + offset
                if k > 0 and o[k - 2] + o[k - 1] == addr:
                    o[k - 1] += nbytes
                else:
                    o[k] = addr
                    o[k + 1] = nbytes
                    k += 2
    array.resize(out, k)
    return out


def copy_segments(const uint64_t[::1] dst_bases not None, const int64_t[::1] dst_indices not None,
                  uint64_t dst_stride, uint64_t dst_offset,
                  const uint64_t[::1] src_bases not None, const int64_t[::1] src_indices not None,
                  uint64_t src_stride, uint64_t src_offset, uint64_t nbytes):
    """Coalesced ``[dst, src, nbytes, ...]`` triples pairing two layouts.

    Tensor ``t`` index ``i`` of the source goes to tensor ``t`` index ``i``
    of the destination. Both sides need the same tensor and index counts.
    """
    cdef size_t nt = dst_bases.shape[0], ni = dst_indices.shape[0]
    if src_bases.shape[0] != nt or src_indices.shape[0] != ni:
        raise ValueError("source and destination counts differ")
    cdef array.array out = _new_u64(3 * nt * ni)
    cdef uint64_t *o = <uint64_t *>out.data.as_ulonglongs
    cdef size_t t, i, k = 0
    cdef uint64_t d, s
    with nogil:
        for t in range(nt):
            for i in range(ni):
                d = dst_bases[t] + <uint64_t>dst_indices[i] * dst_stride + dst_offset
                s = src_bases[t] + <uint64_t>src_indices[i] * src_stride + src_offset
                if k > 0 and o[k - 3] + o[k - 1] == d and o[k - 2] + o[k - 1] == s:
                    o[k - 1] += nbytes
                else:
                    o[k] = d
                    o[k + 1] = s
                    o[k + 2] = nbytes
                    k += 3
    array.resize(out, k)
    return out


def block_pairs(object info, int64_t rows):
    """``(srcs, dsts)`` int64 arrays of a ``{src_block: [dst_block, ...]}`` dict, one entry per destination.

    Only for the plain, valid case, checked here in one pass: a ``dict`` of
    ``int`` keys, each to a non-empty ``list`` or ``tuple`` of ``int``, every
    block in ``[0, rows)``, no destination named twice, none also a source.
    Anything else (another mapping, numpy integers, bools, a bad block)
    gives None: the caller's full check then names what is wrong. What
    ``copy_blocks`` validates for hundreds of blocks in a few microseconds.
    """
    if type(info) is not dict:
        return None
    cdef Py_ssize_t total = 0, k = 0, i, n
    cdef object src, dsts, d
    for src, dsts in (<dict>info).items():
        if type(src) is not int or (type(dsts) is not list and type(dsts) is not tuple) or len(dsts) == 0:
            return None
        total += len(dsts)
    cdef array.array out_src = array.clone(_I64, total, zero=False)
    cdef array.array out_dst = array.clone(_I64, total, zero=False)
    cdef int64_t *os_ = <int64_t *>out_src.data.as_longlongs
    cdef int64_t *od = <int64_t *>out_dst.data.as_longlongs
    cdef int64_t sv, dv
    try:
        for src, dsts in (<dict>info).items():
            sv = src
            if sv < 0 or sv >= rows:
                return None
            n = len(dsts)
            if k + n > total:  # cannot happen (nothing runs between the passes); never write past the arrays
                return None
            for i in range(n):
                d = dsts[i]
                if type(d) is not int:
                    return None
                dv = d
                if dv < 0 or dv >= rows:
                    return None
                os_[k] = sv
                od[k] = dv
                k += 1
    except OverflowError:
        return None
    if k != total:
        return None
    # Destinations distinct and never a source: sort copies of both and merge.
    cdef vector[int64_t] sd, ss
    sd.assign(od, od + total)
    ss.assign(os_, os_ + total)
    _sort(sd.begin(), sd.end())
    _sort(ss.begin(), ss.end())
    cdef size_t a = 0, b = 0
    for i in range(1, total):
        if sd[i] == sd[i - 1]:
            return None
    while a < <size_t>total and b < <size_t>total:
        if sd[a] == ss[b]:
            return None
        if sd[a] < ss[b]:
            a += 1
        else:
            b += 1
    return out_src, out_dst


def copy_now(const uint64_t[::1] triples not None):
    """Run a ``[dst, src, nbytes, ...]`` copy list here and now, without the GIL; the bytes copied.

    For small copies whose hand-off to a ``HostCopyEngine`` thread and back
    would cost more than the copy: the caller's thread is busy until it is
    over, and nothing of it runs after this returns. Callers validate the
    addresses first, as for the engine. A list of ``stream_copy_min`` bytes
    or more is written with streaming stores, as an engine job is.
    """
    cdef size_t n = triples.shape[0], i
    if n % 3:
        raise ValueError("a copy list holds dst, src, nbytes triples")
    cdef uint64_t total = 0
    cdef bint stream
    global _streamed_lists
    for i in range(2, n, 3):
        total += triples[i]
    stream = total >= _stream_min
    if stream:
        _streamed_lists += 1
    with nogil:
        for i in range(0, n, 3):
            _copy(<void *>triples[i], <const void *>triples[i + 1], triples[i + 2], stream)
    return total


cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int sockfd, void *buf, size_t n, int flags)
    int MSG_PEEK
    int MSG_DONTWAIT


cdef ssize_t _peek(int fd, int *err) noexcept nogil:
    # One byte of socket ``fd`` looked at, not taken, without blocking: recv's result (errno in ``err``).
    cdef char byte
    cdef ssize_t n = recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT)
    err[0] = errno
    return n


def peer_closed(int fd):
    """Whether the peer of connected socket ``fd`` closed it (or it failed) with nothing left to read before
    the end; a peek that takes nothing, never blocks."""
    cdef ssize_t n
    cdef int err
    with nogil:
        n = _peek(fd, &err)
    if n > 0:
        return False
    if n == 0:
        return True
    return err not in (EAGAIN, EINTR)


def input_pending(int fd):
    """Whether a read of socket ``fd`` would not block: something is queued, the peer closed it, or it failed
    (a read says which). A peek that takes nothing, never blocks; False only when nothing is there yet."""
    cdef ssize_t n
    cdef int err
    with nogil:
        n = _peek(fd, &err)
    return n >= 0 or err != EAGAIN


cdef extern from *:
    """
    static inline void aio_publish_word(uint64_t *word, uint64_t value) {
        __atomic_store_n(word, value, __ATOMIC_RELEASE);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
    }
    static inline uint64_t aio_read_word(const uint64_t *word) {
        return __atomic_load_n(word, __ATOMIC_ACQUIRE);
    }
    """
    void aio_publish_word(uint64_t *word, uint64_t value) nogil
    uint64_t aio_read_word(const uint64_t *word) nogil


def publish_word(uint64_t addr, uint64_t value):
    """Store ``value`` in the aligned 64-bit word at ``addr`` for other processes to read: every access
    before it is visible before it, and it is visible before any access after it (a full fence follows;
    on x86 one locked store, on aarch64 ``stlr`` then ``dmb ish``)."""
    if addr % 8:
        raise ValueError("the word must be 8-byte aligned")
    aio_publish_word(<uint64_t *>addr, value)


def read_word(uint64_t addr):
    """Load the aligned 64-bit word at ``addr`` that another process publishes (an acquire load: nothing
    read after it is read before it)."""
    if addr % 8:
        raise ValueError("the word must be 8-byte aligned")
    return aio_read_word(<const uint64_t *>addr)


def zip_segments(const uint64_t[::1] dst not None, const uint64_t[::1] src not None):
    """Pair two ``[addr, nbytes, ...]`` streams of equal total into copy triples.

    Segment boundaries of either side split the copy, so layouts with
    different granularity (one contiguous row against several blocks) pair up.
    """
    cdef size_t nd = dst.shape[0], ns = src.shape[0]
    if nd % 2 or ns % 2:
        raise ValueError("streams must hold addr, nbytes pairs")
    cdef array.array out = _new_u64(3 * (nd // 2 + ns // 2))
    cdef uint64_t *o = <uint64_t *>out.data.as_ulonglongs
    cdef size_t i = 0, j = 0, k = 0
    cdef uint64_t da = 0, dl = 0, sa = 0, sl = 0, take
    with nogil:
        while True:
            if dl == 0 and i < nd:
                da = dst[i]
                dl = dst[i + 1]
                i += 2
                continue
            if sl == 0 and j < ns:
                sa = src[j]
                sl = src[j + 1]
                j += 2
                continue
            if dl == 0 or sl == 0:
                break
            take = dl if dl < sl else sl
            if k > 0 and o[k - 3] + o[k - 1] == da and o[k - 2] + o[k - 1] == sa:
                o[k - 1] += take
            else:
                o[k] = da
                o[k + 1] = sa
                o[k + 2] = take
                k += 3
            da += take
            sa += take
            dl -= take
            sl -= take
    if dl != 0 or sl != 0 or i < nd or j < ns:
        raise ValueError("the two streams carry different byte counts")
    array.resize(out, k)
    return out


# --------------------------------------------------------------------------
# Device drivers, loaded at run time
#
# Nothing here needs a device toolkit to build: the entry points are looked up
# with dlsym in the driver library the machine has. A machine without the
# library (or without a device) gets OSError(ENODEV) with a message that
# names what is missing; a driver call that fails gets OSError(EIO).

cdef void *_open_library(str library, str missing) except NULL:
    cdef bytes name = library.encode()
    cdef void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)
    if lib == NULL:
        why = dlerror()
        detail = why.decode(errors="replace") if why != NULL else "not found"
        raise OSError(ENODEV, f"{library} not found: {missing} (dlopen: {detail})")
    return lib


cdef void *_symbol(void *lib, str library, str name, bint required, str needs) except? NULL:
    cdef bytes raw = name.encode()
    cdef void *fn = dlsym(lib, raw)
    if fn == NULL and required:
        raise OSError(ENODEV, f"{library} has no {name}: {needs}")
    return fn


_drivers = {}


def cuda_driver(str library="libcuda.so.1"):
    """The process's :class:`CudaDriver` for ``library`` (loaded once, never unloaded)."""
    drv = _drivers.get(("cuda", library))
    if drv is None:
        drv = CudaDriver(library)
        _drivers[("cuda", library)] = drv
    return drv


def acl_driver(str library="libascendcl.so"):
    """The process's :class:`AclDriver` for ``library`` (loaded once, never unloaded)."""
    drv = _drivers.get(("npu", library))
    if drv is None:
        drv = AclDriver(library)
        _drivers[("npu", library)] = drv
    return drv


cdef class CudaDriver:
    """The CUDA driver API entry points the core uses, from ``libcuda.so.1``.

    Construction loads the library, resolves every symbol and runs
    ``cuInit``; use :func:`cuda_driver` to share one per process.
    """

    def __cinit__(self, str library="libcuda.so.1"):
        cdef CUresult rc
        needs = "the NVIDIA driver is too old (R525 / CUDA 12.0 or newer is needed)"
        self._library = library
        self._contexts = {}
        self._retains = {}
        self._lib = _open_library(library, "no NVIDIA driver is installed on this machine")
        self._init = <cuInit_t>_symbol(self._lib, library, "cuInit", True, needs)
        self._error_string = <cuGetErrorString_t>_symbol(self._lib, library, "cuGetErrorString", True, needs)
        self._error_name = <cuGetErrorName_t>_symbol(self._lib, library, "cuGetErrorName", True, needs)
        self._device_get = <cuDeviceGet_t>_symbol(self._lib, library, "cuDeviceGet", True, needs)
        self._device_count = <cuDeviceGetCount_t>_symbol(self._lib, library, "cuDeviceGetCount", True, needs)
        self._primary_retain = <cuDevicePrimaryCtxRetain_t>_symbol(
            self._lib, library, "cuDevicePrimaryCtxRetain", True, needs)
        self._ctx_push = <cuCtxPushCurrent_t>_symbol(self._lib, library, "cuCtxPushCurrent_v2", True, needs)
        self._ctx_pop = <cuCtxPopCurrent_t>_symbol(self._lib, library, "cuCtxPopCurrent_v2", True, needs)
        self._launch_host_func = <cuLaunchHostFunc_t>_symbol(self._lib, library, "cuLaunchHostFunc", True, needs)
        self._primary_release = <cuDevicePrimaryCtxRelease_t>_symbol(
            self._lib, library, "cuDevicePrimaryCtxRelease_v2", True, needs)
        self._is_capturing = <cuStreamIsCapturing_t>_symbol(self._lib, library, "cuStreamIsCapturing", True, needs)
        self._device_attribute = <cuDeviceGetAttribute_t>_symbol(
            self._lib, library, "cuDeviceGetAttribute", True, needs)
        self._host_device_pointer = <cuMemHostGetDevicePointer_t>_symbol(
            self._lib, library, "cuMemHostGetDevicePointer_v2", True, needs)
        self._batch_v2 = <cuMemcpyBatchAsync_v2_t>_symbol(self._lib, library, "cuMemcpyBatchAsync_v2", False, "")
        self._batch_v1 = <cuMemcpyBatchAsync_v1_t>_symbol(self._lib, library, "cuMemcpyBatchAsync", False, "")
        # Optional: without them a notifier posts by host function only.
        self._event_create = <cuEventCreate_t>_symbol(self._lib, library, "cuEventCreate", False, "")
        self._event_record = <cuEventRecord_t>_symbol(self._lib, library, "cuEventRecord", False, "")
        self._event_query = <cuEventQuery_t>_symbol(self._lib, library, "cuEventQuery", False, "")
        self._event_destroy = <cuEventDestroy_t>_symbol(self._lib, library, "cuEventDestroy_v2", False, "")
        with nogil:
            rc = self._init(0)
        if rc != CUDA_SUCCESS:
            raise OSError(ENODEV, f"cuInit failed: {self._describe(rc)}")

    cdef CUevent _recorded_event(self, CUstream stream) noexcept nogil:
        # A new event recorded on ``stream`` (the caller's context current), or NULL where the driver has no
        # events or refuses one.
        cdef CUevent event = NULL
        if self._event_create == NULL or self._event_create(&event, CU_EVENT_DISABLE_TIMING) != CUDA_SUCCESS:
            return NULL
        if self._event_record(event, stream) != CUDA_SUCCESS:
            self._event_destroy(event)
            return NULL
        return event

    cdef str _describe(self, CUresult rc):
        cdef const char *name = NULL
        cdef const char *text = NULL
        self._error_name(rc, &name)
        self._error_string(rc, &text)
        n = name.decode(errors="replace") if name != NULL else f"CUresult {rc}"
        t = text.decode(errors="replace") if text != NULL else "unknown error"
        return f"{n} ({t})"

    cdef CUcontext _retain(self, int device) except? NULL:
        # The primary context (the one the CUDA runtime, and so torch, uses), retained once per user:
        # each _retain is matched by one _release, and the last release gives it back to the driver.
        cdef CUdevice dev
        cdef CUcontext ctx = NULL
        cdef CUresult rc
        cached = self._contexts.get(device)
        if cached is not None:
            self._retains[device] += 1
            return <CUcontext><size_t>cached
        rc = self._device_get(&dev, device)
        if rc != CUDA_SUCCESS:
            raise OSError(ENODEV, f"CUDA device {device}: {self._describe(rc)}")
        rc = self._primary_retain(&ctx, dev)
        if rc != CUDA_SUCCESS:
            raise OSError(EIO, f"cuDevicePrimaryCtxRetain({device}) failed: {self._describe(rc)}")
        self._contexts[device] = <size_t>ctx
        self._retains[device] = 1
        return ctx

    cdef void _release(self, int device):
        cdef CUdevice dev
        left = self._retains.get(device, 0) - 1
        if left < 0:
            return
        if left > 0:
            self._retains[device] = left
            return
        del self._retains[device]
        del self._contexts[device]
        if self._device_get(&dev, device) == CUDA_SUCCESS:
            self._primary_release(dev)

    def retain_context(self, int device):
        """Retain ``device``'s primary context for the caller (matched by :meth:`release_context`)."""
        self._retain(device)

    def release_context(self, int device):
        """Release one :meth:`retain_context`; the last one gives the context back to the driver."""
        self._release(device)

    def retained(self, int device):
        """How many users hold ``device``'s primary context through this driver object."""
        return self._retains.get(device, 0)

    def can_map_host(self, int device):
        """Whether kernels on ``device`` can use registered host memory at its host address."""
        cdef CUdevice dev
        cdef int value = 0
        if self._device_get(&dev, device) != CUDA_SUCCESS:
            return False
        if self._device_attribute(&value, CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, dev) != 0:
            return False
        return value != 0

    def host_device_pointer(self, int device, size_t address):
        """The device address of registered (mapped) host memory at ``address``; OSError(EIO) if unmapped."""
        cdef CUdeviceptr dptr = 0
        cdef CUcontext ctx, popped
        cdef CUresult rc
        ctx = self._retain(device)
        try:
            rc = self._ctx_push(ctx)
            if rc == CUDA_SUCCESS:
                rc = self._host_device_pointer(&dptr, <void *>address, 0)
                self._ctx_pop(&popped)
        finally:
            self._release(device)
        if rc != CUDA_SUCCESS:
            raise OSError(EIO, f"cuMemHostGetDevicePointer failed: {self._describe(rc)}")
        return dptr

    @property
    def library(self):
        return self._library

    @property
    def has_batch_copy(self):
        """Whether the driver offers ``cuMemcpyBatchAsync`` (CUDA 12.8+)."""
        return self._batch_v2 != NULL or self._batch_v1 != NULL

    def device_count(self):
        """Number of CUDA devices the driver sees."""
        cdef int n = 0
        cdef CUresult rc = self._device_count(&n)
        if rc != CUDA_SUCCESS:
            raise OSError(EIO, f"cuDeviceGetCount failed: {self._describe(rc)}")
        return n

    def error_text(self, int code):
        """``NAME (description)`` of a ``CUresult``."""
        return self._describe(code)

    def memcpy_batch(self, int device, size_t stream, const uint64_t[::1] dsts not None,
                     const uint64_t[::1] srcs not None, const uint64_t[::1] sizes not None):
        """Enqueue ``count`` copies on ``stream`` with one ``cuMemcpyBatchAsync``.

        The copies run in stream order after earlier work (source access
        order STREAM). Every pointer must be device memory or page-locked
        host memory that stays valid until the stream passes the copies.
        Returns the bytes enqueued. OSError(ENODEV) without batch copies,
        OSError(EIO) when the driver refuses.
        """
        cdef size_t n = dsts.shape[0], i
        cdef uint64_t total = 0
        cdef CUmemcpyAttributes attr
        cdef size_t attr_idx = 0, fail_idx = 0
        cdef CUcontext ctx, popped
        cdef CUresult rc
        if srcs.shape[0] != n or sizes.shape[0] != n:
            raise ValueError("dsts, srcs and sizes must have one entry per copy")
        if self._batch_v2 == NULL and self._batch_v1 == NULL:
            raise OSError(ENODEV, f"{self._library} has no cuMemcpyBatchAsync (CUDA 12.8 or newer is needed)")
        if stream == 0:
            raise ValueError("batch copies cannot use the legacy default stream (0)")
        if n == 0:
            return 0
        for i in range(n):
            total += sizes[i]
        ctx = self._retain(device)
        attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attr.srcLocHint.type = 0
        attr.srcLocHint.id = 0
        attr.dstLocHint.type = 0
        attr.dstLocHint.id = 0
        attr.flags = CU_MEMCPY_FLAG_DEFAULT
        with nogil:
            rc = self._ctx_push(ctx)
            if rc == CUDA_SUCCESS:
                if self._batch_v2 != NULL:
                    rc = self._batch_v2(<CUdeviceptr *>&dsts[0], <CUdeviceptr *>&srcs[0], <size_t *>&sizes[0], n,
                                        &attr, &attr_idx, 1, <CUstream>stream)
                else:
                    rc = self._batch_v1(<CUdeviceptr *>&dsts[0], <CUdeviceptr *>&srcs[0], <size_t *>&sizes[0], n,
                                        &attr, &attr_idx, 1, &fail_idx, <CUstream>stream)
                self._ctx_pop(&popped)
        self._release(device)
        if rc != CUDA_SUCCESS:
            raise OSError(EIO, f"cuMemcpyBatchAsync of {n} copies failed: {self._describe(rc)}")
        return total


cdef class AclDriver:
    """The Ascend ACL runtime entry points the core uses, from ``libascendcl.so``."""

    def __cinit__(self, str library="libascendcl.so"):
        needs = "the CANN runtime is too old (aclrtLaunchCallback and report threads are needed)"
        self._library = library
        self._lib = _open_library(library, "no Ascend CANN runtime is installed or on LD_LIBRARY_PATH")
        self._launch_callback = <aclrtLaunchCallback_t>_symbol(self._lib, library, "aclrtLaunchCallback", True, needs)
        self._subscribe = <aclrtSubscribeReport_t>_symbol(self._lib, library, "aclrtSubscribeReport", True, needs)
        self._unsubscribe = <aclrtUnSubscribeReport_t>_symbol(self._lib, library, "aclrtUnSubscribeReport", True, needs)
        self._process_report = <aclrtProcessReport_t>_symbol(self._lib, library, "aclrtProcessReport", True, needs)
        self._get_context = <aclrtGetCurrentContext_t>_symbol(self._lib, library, "aclrtGetCurrentContext", True, needs)
        self._set_context = <aclrtSetCurrentContext_t>_symbol(self._lib, library, "aclrtSetCurrentContext", True, needs)
        self._recent_error = <aclGetRecentErrMsg_t>_symbol(self._lib, library, "aclGetRecentErrMsg", False, "")

    cdef str _describe(self, aclError rc):
        cdef const char *msg = NULL
        if self._recent_error != NULL:
            msg = self._recent_error()
        detail = msg.decode(errors="replace") if msg != NULL else "no detail"
        return f"aclError {rc} ({detail})"

    @property
    def library(self):
        return self._library


# --------------------------------------------------------------------------
# StreamNotifier


cdef NotifyState *_state_new(CompletionQueue queue):
    cdef NotifyState *st = new NotifyState()
    pthread_mutex_init(&st.lock, NULL)
    pthread_cond_init(&st.idle, NULL)
    st.queue = <void *>queue
    st.closed = False
    st.inflight = 0
    st.next_seq = 0
    return st


cdef void _state_free(NotifyState *st) noexcept nogil:
    pthread_cond_destroy(&st.idle)
    pthread_mutex_destroy(&st.lock)
    del st


cdef NotifySlot *_state_arm(NotifyState *st, uint64_t token, int64_t aux) except NULL:
    cdef NotifySlot *slot
    pthread_mutex_lock(&st.lock)
    if st.closed:
        pthread_mutex_unlock(&st.lock)
        raise ValueError("StreamNotifier is closed")
    if st.slots.count(token):
        pthread_mutex_unlock(&st.lock)
        raise ValueError(f"token {token} is already in use")
    slot = new NotifySlot()
    slot.state = st
    slot.token = token
    slot.aux = aux
    slot.cancelled = False
    slot.refs = 1
    slot.posted = False
    slot.behind = False
    st.next_seq += 1
    slot.seq = st.next_seq
    st.slots[token] = <void *>slot
    st.inflight += 1
    pthread_mutex_unlock(&st.lock)
    return slot


cdef void _state_disarm(NotifyState *st, NotifySlot *slot) noexcept nogil:
    # The driver refused the host function: it will never run (and nothing else holds the slot).
    pthread_mutex_lock(&st.lock)
    st.slots.erase(slot.token)
    if slot.behind:
        st.behind.erase(slot.seq)
    _state_inflight(st, -1)
    pthread_mutex_unlock(&st.lock)
    del slot


cdef bint _state_cancel(NotifyState *st, uint64_t token) noexcept nogil:
    cdef bint found = False
    pthread_mutex_lock(&st.lock)
    it = st.slots.find(token)
    if it != st.slots.end():
        (<NotifySlot *>deref(it).second).cancelled = True
        found = True
    pthread_mutex_unlock(&st.lock)
    return found


cdef size_t _state_pending(NotifyState *st) noexcept nogil:
    cdef size_t n
    pthread_mutex_lock(&st.lock)
    n = st.slots.size()
    pthread_mutex_unlock(&st.lock)
    return n


cdef bint _state_drain(NotifyState *st, double timeout_s) noexcept nogil:
    # Refuse new slots and wait until every enqueued host function ran.
    cdef timespec deadline
    cdef bint drained
    _deadline_in(&deadline, _wait_ms(timeout_s))
    pthread_mutex_lock(&st.lock)
    st.closed = True
    while st.inflight != 0:
        if pthread_cond_timedwait(&st.idle, &st.lock, &deadline) != 0:
            break  # ETIMEDOUT (any other error would come back at once every time)
    drained = st.inflight == 0
    pthread_mutex_unlock(&st.lock)
    return drained


cdef void _notify_fire(void *arg) noexcept nogil:
    """The host function: the stream reached it, so everything enqueued before is done.

    Runs on a driver thread without the GIL and makes no driver call: it
    posts the slot's record (CANCELLED if the token was cancelled meanwhile)
    unless the event watcher did, and lets go of the slot (freed by the last
    holder). It runs under the state lock, so the owner, which frees the
    state once no host function is in flight, cannot free it first.
    """
    cdef NotifySlot *slot = <NotifySlot *>arg
    cdef NotifyState *st = slot.state
    cdef bint last
    pthread_mutex_lock(&st.lock)
    _slot_post(slot)
    _state_inflight(st, -1)
    slot.refs -= 1
    last = slot.refs == 0
    pthread_mutex_unlock(&st.lock)
    if last:
        del slot


cdef bint _slot_post(NotifySlot *slot) noexcept nogil:
    # With the state lock held: post the slot's record unless it was posted already; whether this posted it.
    # Its token is free from then on (a new slot may hold it while this one waits for its host function).
    if slot.posted:
        return False
    slot.posted = True
    if slot.behind:
        slot.behind = False
        slot.state.behind.erase(slot.seq)
    it = slot.state.slots.find(slot.token)
    if it != slot.state.slots.end() and deref(it).second == <void *>slot:
        slot.state.slots.erase(it)
    if slot.cancelled:
        (<CompletionQueue>slot.state.queue).push(slot.token, -ECANCELED, 0)
    else:
        (<CompletionQueue>slot.state.queue).push(slot.token, 0, slot.aux)
    return True


cdef void _slot_leave_behind(NotifySlot *slot) noexcept nogil:
    # With the state lock held: only the slot's host function will post it; until it does, nothing after it
    # is posted early (the records of one notifier keep their order).
    if not slot.posted and not slot.behind:
        slot.behind = True
        slot.state.behind.insert(slot.seq)


cdef void _state_inflight(NotifyState *st, int delta) noexcept nogil:
    # With the state lock held: count host functions (and notify calls) in flight; close waits for none.
    st.inflight += delta
    if st.inflight == 0:
        pthread_cond_broadcast(&st.idle)


cdef void _state_hold(NotifyState *st, int delta) noexcept nogil:
    # A notify call in progress counts as in flight, so close cannot free what it still touches.
    pthread_mutex_lock(&st.lock)
    _state_inflight(st, delta)
    pthread_mutex_unlock(&st.lock)


cdef int64_t _mono_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef void _watch_done(EventWatch *w, WatchItem *item, bint reached) noexcept nogil:
    # The watcher lets go of an item: posts its record first if the event says the stream is past it.
    cdef NotifySlot *slot = <NotifySlot *>item.slot
    cdef NotifyState *st = slot.state
    cdef bint last
    pthread_mutex_lock(&st.lock)
    if reached and (st.behind.empty() or deref(st.behind.begin()) > slot.seq):
        if _slot_post(slot):
            w.early += 1
    elif not slot.posted:
        _slot_leave_behind(slot)
        w.expired += 1
    slot.refs -= 1
    last = slot.refs == 0
    pthread_mutex_unlock(&st.lock)
    if last:
        del slot
    w.destroy(item.event)


cdef void _watch_free(EventWatch *w) noexcept nogil:
    pthread_cond_destroy(&w.wake)
    pthread_mutex_destroy(&w.lock)
    del w


cdef void *_watch_main(void *arg) noexcept nogil:
    """The event watcher: polls the oldest watched event until it completes or its window ends.

    Items are taken in notification order and posted in that order: when the
    oldest is not complete, none after it is posted early, and when its
    window ends every item then held is given up to its host function, so
    the watcher never posts a record ahead of an earlier one of this notifier.
    Between polls it yields the core; with nothing watched it sleeps.
    """
    cdef EventWatch *w = <EventWatch *>arg
    cdef vector[WatchItem] mine
    cdef size_t head = 0, i
    cdef CUresult rc
    cdef CUcontext popped
    cdef bint current = w.ctx_push(w.ctx) == CUDA_SUCCESS
    pthread_mutex_lock(&w.lock)
    while True:
        while w.items.empty() and head == mine.size() and not w.stop:
            pthread_cond_wait(&w.wake, &w.lock)
        for i in range(w.items.size()):
            mine.push_back(w.items[i])
        w.items.clear()
        if w.stop:
            break
        pthread_mutex_unlock(&w.lock)
        while head < mine.size():
            rc = w.query(mine[head].event) if current else -1  # no context on this thread: give up at once
            if rc == CUDA_SUCCESS:
                _watch_done(w, &mine[head], True)
                head += 1
            elif rc != CUDA_ERROR_NOT_READY or _mono_ns() >= mine[head].deadline_ns:
                # An error, or the window is over: the host functions post these, in order.
                for i in range(head, mine.size()):
                    _watch_done(w, &mine[i], False)
                head = mine.size()
            else:
                break
        if head == mine.size():
            mine.clear()
            head = 0
        else:
            sched_yield()
        pthread_mutex_lock(&w.lock)
    pthread_mutex_unlock(&w.lock)
    for i in range(head, mine.size()):
        _watch_done(w, &mine[i], False)
    if current:
        w.ctx_pop(&popped)
    return NULL


DEF BACKEND_CUDA = 1
DEF BACKEND_NPU = 2
DEF BACKEND_HOST = 3
DEF REPORT_WAIT_MS = 100
DEF REPORT_ERROR_PAUSE_MS = 10
DEF PRUNE_AT = 64
DEF OP_COPY = 1
DEF OP_FIRE = 2
DEF OP_SIGNAL = 3
DEF OP_WAIT = 4


cdef void *_report_main(void *arg) noexcept nogil:
    (<_AclReporter>arg)._loop()
    return NULL


_reporters = {}


def _acl_reporter(AclDriver acl):
    """The process's one report thread for ``acl`` (started on the first subscription)."""
    found = _reporters.get(acl.library)
    if found is None or _foreign((<_AclReporter>found)._made_by):  # a parent's: its thread is not here
        found = _reporters[acl.library] = _AclReporter(acl)
    return found


cdef class _AclReporter:
    """The one Ascend report thread of the process, shared by every StreamNotifier.

    ACL subscribes a stream to one report thread only, so notifiers cannot
    each run their own. Streams are subscribed on first use and counted per
    notifier that uses them; the last notifier to let go unsubscribes. With
    nothing subscribed the thread sleeps on a condition (it never calls
    ``aclrtProcessReport`` then, so it cannot spin on its errors).
    """

    def __cinit__(self, AclDriver acl):
        self._made_by = _generation
        self._acl = acl
        self._ctx = NULL
        self._started = False
        self._stop = False
        self._rounds = 0
        pthread_mutex_init(&self._lock, NULL)
        pthread_cond_init(&self._wake, NULL)

    def __dealloc__(self):
        # Module-lifetime object: reached only at interpreter exit.
        if _foreign(self._made_by):
            return  # a forked child's copy: the thread to join is the parent's; its lock may be held
        if self._started:
            pthread_mutex_lock(&self._lock)
            self._stop = True
            pthread_cond_broadcast(&self._wake)
            pthread_mutex_unlock(&self._lock)
            with nogil:
                pthread_join(self._thread, NULL)
        pthread_cond_destroy(&self._wake)
        pthread_mutex_destroy(&self._lock)

    @property
    def rounds(self):
        """How many times the thread called ``aclrtProcessReport`` (tests check that it does not spin)."""
        return self._rounds

    @property
    def subscribed(self):
        return self._streams.size()

    @property
    def thread_id(self):
        return <uint64_t>self._thread if self._started else 0

    cdef void _loop(self) noexcept nogil:
        cdef aclError rc
        cdef timespec deadline
        cdef bint context_set = False
        while True:
            pthread_mutex_lock(&self._lock)
            while self._streams.empty() and not self._stop:
                pthread_cond_wait(&self._wake, &self._lock)
            if self._stop:
                pthread_mutex_unlock(&self._lock)
                return
            if not context_set:
                self._acl._set_context(self._ctx)
                context_set = True
            self._rounds += 1
            pthread_mutex_unlock(&self._lock)
            # Blocks in the runtime until a callback is due; the time-out only bounds how late a change is seen.
            rc = self._acl._process_report(REPORT_WAIT_MS)
            if rc != ACL_SUCCESS:
                # A time-out, or a runtime that refuses at once: pause so an immediate error cannot spin.
                pthread_mutex_lock(&self._lock)
                if not self._stop:
                    _deadline_in(&deadline, REPORT_ERROR_PAUSE_MS)
                    pthread_cond_timedwait(&self._wake, &self._lock, &deadline)
                pthread_mutex_unlock(&self._lock)

    cdef int _subscribe(self, uint64_t stream, aclrtContext ctx) except -1:
        cdef aclError arc
        cdef bint fresh = False
        _check_here("Ascend report thread", self._made_by)
        pthread_mutex_lock(&self._lock)
        if self._ctx == NULL:
            self._ctx = ctx
        if not self._started:
            if pthread_create(&self._thread, NULL, _report_main, <void *>self) != 0:
                pthread_mutex_unlock(&self._lock)
                raise OSError(EIO, "could not start the Ascend report thread")
            self._started = True
        if self._streams.count(stream):
            self._streams[stream] += 1
            pthread_mutex_unlock(&self._lock)
            return 0
        pthread_mutex_unlock(&self._lock)
        with nogil:
            self._acl._set_context(ctx)
            arc = self._acl._subscribe(<uint64_t>self._thread, <aclrtStream>stream)
        if arc != ACL_SUCCESS:
            raise OSError(EIO, f"aclrtSubscribeReport failed: {self._acl._describe(arc)}")
        pthread_mutex_lock(&self._lock)
        self._streams[stream] += 1
        pthread_cond_broadcast(&self._wake)
        pthread_mutex_unlock(&self._lock)
        return 0

    cdef void _unsubscribe(self, uint64_t stream, aclrtContext ctx) noexcept nogil:
        cdef bint last = False
        pthread_mutex_lock(&self._lock)
        if self._streams.count(stream):
            self._streams[stream] -= 1
            if self._streams[stream] <= 0:
                self._streams.erase(stream)
                last = True
        pthread_mutex_unlock(&self._lock)
        if last:
            self._acl._set_context(ctx)
            self._acl._unsubscribe(<uint64_t>self._thread, <aclrtStream>stream)


_host_streams = {}


cdef class StreamNotifier:
    """Completion records for "everything enqueued on this stream so far".

    :meth:`notify` enqueues a host function on a stream; when the stream
    reaches it, the record ``(token, 0, aux)`` is posted to the queue. No
    thread waits per operation (on CUDA an event watcher may post it first,
    see ``poll_us``): CUDA runs the host function
    on its own driver thread (``cuLaunchHostFunc``); Ascend runs it on the
    process's one report thread (``aclrtLaunchCallback``); the host backend
    runs it on the :class:`HostStream`'s own thread, in order with its copies.

    Queued device work cannot be recalled: :meth:`cancel` only marks the
    token, whose record then still arrives (with ``CANCELLED``) once the
    stream gets there. Whatever memory that work touches must stay alive
    until the record, as for every engine.

    ``backend`` is ``"cuda"``, ``"npu"`` or ``"host"``; ``device`` the device
    ordinal; ``library`` overrides the driver library's name. OSError(ENODEV)
    when the driver or the device is missing.

    ``poll_us`` (CUDA only): a driver's callback thread runs a host function
    well after the stream reached it (250-350 us after a kernel on a VM). With
    ``poll_us > 0`` each notification also records an event just before its
    host function, and one watcher thread polls the oldest such event for up
    to ``poll_us`` microseconds, yielding the core between polls, and posts
    the record the moment it completes. The host function still runs and
    posts whatever the watcher did not (a longer wait, a driver without
    events); a record is posted once. 0: host functions only.
    """

    def __cinit__(self, CompletionQueue queue not None, str backend, int device=0, library=None,
                  int poll_us=0):
        cdef aclError arc
        cdef int err
        self._made_by = _generation
        self._closed = True
        self._state = NULL
        self._watch = NULL
        self._retained = False
        if poll_us < 0:
            raise ValueError(f"poll_us must be >= 0, got {poll_us}")
        queue._check_open()
        if backend == "cuda":
            self._backend = BACKEND_CUDA
            self._cuda = cuda_driver("libcuda.so.1" if library is None else library)
            self._ctx = self._cuda._retain(device)
            self._retained = True
        elif backend == "npu":
            self._backend = BACKEND_NPU
            self._acl = acl_driver("libascendcl.so" if library is None else library)
            arc = self._acl._get_context(&self._acl_ctx)
            if arc != ACL_SUCCESS or self._acl_ctx == NULL:
                raise OSError(ENODEV, f"no current Ascend context on this thread (set the NPU device first): "
                                      f"{self._acl._describe(arc)}")
            self._reporter = _acl_reporter(self._acl)
        elif backend == "host":
            self._backend = BACKEND_HOST
        else:
            raise ValueError(f"backend must be 'cuda', 'npu' or 'host', got {backend!r}")
        self._device = device
        self._queue = queue
        if (self._backend == BACKEND_CUDA and poll_us > 0 and self._cuda._event_create != NULL
                and self._cuda._event_record != NULL and self._cuda._event_query != NULL
                and self._cuda._event_destroy != NULL):
            self._watch = new EventWatch()
            pthread_mutex_init(&self._watch.lock, NULL)
            pthread_cond_init(&self._watch.wake, NULL)
            self._watch.stop = False
            self._watch.poll_ns = <int64_t>poll_us * 1000
            self._watch.ctx = self._ctx
            self._watch.ctx_push = self._cuda._ctx_push
            self._watch.ctx_pop = self._cuda._ctx_pop
            self._watch.query = self._cuda._event_query
            self._watch.destroy = self._cuda._event_destroy
            self._watch.early = 0
            self._watch.expired = 0
            err = pthread_create(&self._watch.thread, NULL, _watch_main, <void *>self._watch)
            if err != 0:
                _watch_free(self._watch)
                self._watch = NULL
                self._retained = False
                self._cuda._release(device)
                raise OSError(err, "could not start the event watcher thread")
        self._state = _state_new(queue)
        self._closed = False
        self._counted = True
        _live["StreamNotifier"] += 1

    def __dealloc__(self):
        if self._counted:
            self._shutdown(1.0)

    def __del__(self):
        if self._counted and not _foreign(self._made_by):
            _warnings.warn("StreamNotifier was not closed", ResourceWarning, stacklevel=2)

    @property
    def backend(self):
        return {BACKEND_CUDA: "cuda", BACKEND_NPU: "npu"}.get(self._backend, "host")

    @property
    def device(self):
        return self._device

    @property
    def closed(self):
        return self._closed

    @property
    def watching(self):
        """Whether an event watcher posts records ahead of the host functions (CUDA, ``poll_us > 0``)."""
        return self._watch != NULL

    @property
    def watch_counts(self):
        """``(early, expired)``: records the watcher posted before the host function, and watched
        notifications it gave up to the host function (window over, or a driver error)."""
        _check_here("StreamNotifier", self._made_by)
        if self._watch == NULL or self._state == NULL:
            return (0, 0)
        pthread_mutex_lock(&self._state.lock)  # what _watch_done writes them under
        out = (self._watch.early, self._watch.expired)
        pthread_mutex_unlock(&self._state.lock)
        return out

    @property
    def subscribed(self):
        """Ascend streams this notifier holds a report subscription for."""
        return [self._subscribed[i] for i in range(self._subscribed.size())]

    def notify(self, uint64_t token, size_t stream, int64_t aux=0):
        """Post ``(token, 0, aux)`` once ``stream`` has finished all work enqueued so far.

        ``stream`` is the raw handle (``torch.cuda.Stream.cuda_stream``, the
        NPU stream's handle, or :attr:`HostStream.handle`); 0 is the legacy
        default stream. ValueError for a token in use or a closed notifier;
        OSError(EBUSY) for a CUDA stream being captured into a graph (a host
        function would become part of the graph); OSError(EIO) when the
        driver refuses (no record is posted then).
        """
        cdef NotifySlot *slot
        cdef CUresult rc = 0
        cdef aclError arc = 0
        cdef CUcontext popped
        cdef int capture = CU_STREAM_CAPTURE_STATUS_NONE
        cdef bint known = False
        cdef size_t i
        cdef HostStream host
        cdef HostOp *op
        cdef CUevent event
        cdef WatchItem item
        cdef NotifyState *st
        cdef bint watching
        _check_here("StreamNotifier", self._made_by)
        if self._closed:
            raise ValueError("StreamNotifier is closed")
        if self._backend == BACKEND_CUDA:
            with nogil:
                rc = self._cuda._ctx_push(self._ctx)
                if rc == CUDA_SUCCESS:
                    rc = self._cuda._is_capturing(<CUstream>stream, &capture)
                    self._cuda._ctx_pop(&popped)
            if rc != CUDA_SUCCESS:
                raise OSError(EIO, f"cuStreamIsCapturing failed: {self._cuda._describe(rc)}")
            if capture != CU_STREAM_CAPTURE_STATUS_NONE:
                raise OSError(_errno.EBUSY, "the stream is being captured into a CUDA graph: a completion "
                                            "notification cannot be part of a graph; record it outside the capture")
            slot = _state_arm(self._state, token, aux)
            st = self._state
            watching = self._watch != NULL
            if watching:
                _state_hold(st, 1)  # until the watcher has the item: close waits, the watcher stays
            try:
                event = NULL
                with nogil:
                    rc = self._cuda._ctx_push(self._ctx)
                    if rc == CUDA_SUCCESS:
                        if watching:
                            # The event goes first: recorded after the host function it would wait for it.
                            event = self._cuda._recorded_event(<CUstream>stream)
                        if event != NULL:
                            slot.refs = 2  # before the host function can run and let go of it
                        elif watching:
                            pthread_mutex_lock(&st.lock)
                            _slot_leave_behind(slot)  # unwatched: nothing after it is posted before it
                            pthread_mutex_unlock(&st.lock)
                        rc = self._cuda._launch_host_func(<CUstream>stream, _notify_fire, <void *>slot)
                        if rc != CUDA_SUCCESS and event != NULL:
                            self._cuda._event_destroy(event)
                            event = NULL
                            slot.refs = 1
                        self._cuda._ctx_pop(&popped)
                if rc != CUDA_SUCCESS:
                    _state_disarm(st, slot)
                    raise OSError(EIO, f"cuLaunchHostFunc failed: {self._cuda._describe(rc)}")
                if event != NULL:
                    item.slot = <void *>slot
                    item.event = event
                    item.deadline_ns = _mono_ns() + self._watch.poll_ns
                    pthread_mutex_lock(&self._watch.lock)
                    self._watch.items.push_back(item)
                    pthread_cond_signal(&self._watch.wake)
                    pthread_mutex_unlock(&self._watch.lock)
            finally:
                if watching:
                    _state_hold(st, -1)
            return
        if self._backend == BACKEND_HOST:
            host = _host_streams.get(stream)
            if host is None:
                raise OSError(EIO, f"no open host stream has handle {stream:#x}")
            slot = _state_arm(self._state, token, aux)
            op = new HostOp()
            op.kind = OP_FIRE
            op.slot = <void *>slot
            try:
                host._push(op)
            except BaseException:
                del op
                _state_disarm(self._state, slot)
                raise
            return
        for i in range(self._subscribed.size()):
            if self._subscribed[i] == stream:
                known = True
        if not known:
            if self._subscribed.size() >= PRUNE_AT:
                self._prune()
            self._reporter._subscribe(stream, self._acl_ctx)
            self._subscribed.push_back(stream)
        slot = _state_arm(self._state, token, aux)
        with nogil:
            # The calling thread may not be the one that opened the notifier: launch in its context.
            self._acl._set_context(self._acl_ctx)
            arc = self._acl._launch_callback(_notify_fire, <void *>slot, ACL_CALLBACK_NO_BLOCK, <aclrtStream>stream)
        if arc != ACL_SUCCESS:
            _state_disarm(self._state, slot)
            raise OSError(EIO, f"aclrtLaunchCallback failed: {self._acl._describe(arc)}")

    def release_stream(self, size_t stream):
        """Drop this notifier's report subscription of an Ascend ``stream`` that is going away.

        Call it only once the stream has no notification pending (a
        destroyed stream's handle may be reused). No-op elsewhere.
        """
        cdef size_t i
        cdef vector[uint64_t] kept
        cdef bint found = False
        _check_here("StreamNotifier", self._made_by)
        if self._backend != BACKEND_NPU:
            return
        for i in range(self._subscribed.size()):
            if self._subscribed[i] == stream:
                found = True
            else:
                kept.push_back(self._subscribed[i])
        if found:
            self._subscribed = kept
            with nogil:
                self._reporter._unsubscribe(stream, self._acl_ctx)

    cdef _prune(self):
        # Many streams seen: let go of every subscription but the copy stream's (the first one); a
        # stream used again is subscribed again. Only when nothing is pending, so no callback is lost.
        cdef size_t i
        if _state_pending(self._state) != 0:
            return
        for i in range(1, self._subscribed.size()):
            with nogil:
                self._reporter._unsubscribe(self._subscribed[i], self._acl_ctx)
        self._subscribed.resize(1)

    def cancel(self, uint64_t token):
        """Mark ``token`` cancelled; its record (CANCELLED) comes when the stream gets there.

        Idempotent; True if the token was pending.
        """
        _check_here("StreamNotifier", self._made_by)
        if self._state == NULL:
            return False
        return _state_cancel(self._state, token)

    def pending(self):
        """Notifications whose record has not been posted yet."""
        _check_here("StreamNotifier", self._made_by)
        if self._state == NULL:
            return 0
        return _state_pending(self._state)

    def close(self, double timeout=30.0):
        """Wait (up to ``timeout`` seconds) for enqueued notifications, then release; whether the device
        reached every one (True too when already closed).

        Every record still arrives before close returns. If the device does
        not get there in time, the bookkeeping is left allocated (and a
        ResourceWarning says so) so that a late host function stays safe.
        The retained CUDA primary context and the Ascend report subscriptions
        are given back. Idempotent.

        A close() while another thread closes the notifier waits for that
        one, up to ``timeout``, and then answers as for a closed notifier
        (True; False if that one still runs): only the first says whether the
        device got there. A negative ``timeout`` has passed already and an
        infinite one has no bound; NaN raises ValueError.

        In a forked child, for a notifier of the parent: nothing is waited
        for or given back (the host functions, threads and subscriptions are
        the parent's); the notifier is only marked closed, and False returned.
        """
        cdef timespec deadline
        _check_timeout(timeout)
        if self._counted and (not self._closed or _foreign(self._made_by)):
            return self._shutdown(timeout)
        if self._counted:
            _deadline_in(&deadline, _wait_ms(timeout))
            with nogil:
                pthread_mutex_lock(&_close_lock)
                while self._counted:
                    if pthread_cond_timedwait(&_close_cond, &_close_lock, &deadline) != 0:
                        break
                pthread_mutex_unlock(&_close_lock)
            return not self._counted
        return True

    cdef bint _shutdown(self, double timeout_s):
        cdef bint drained = True
        cdef size_t i
        # Claimed with the GIL held, before the drain lets it go: a concurrent close() waits for this one (see
        # close) instead of draining a state this one frees. _counted is cleared once it is over.
        self._closed = True
        if _foreign(self._made_by):
            # A forked child: the bookkeeping is shared with the parent's host functions and watcher thread
            # (one of which may have held its lock at the fork), the context and subscriptions are the
            # parent's. Let go of, not freed nor released.
            self._state = NULL
            self._watch = NULL
            self._retained = False
            self._subscribed.clear()
            if self._counted:
                self._counted = False
                _uncount("StreamNotifier")
            return False
        try:
            if self._state != NULL:
                with nogil:
                    drained = _state_drain(self._state, timeout_s)
            if self._watch != NULL:
                # After the drain (the watcher may post a record the host function has not yet), before the state
                # is freed (the watcher's items point into it). Its items left go to their host functions.
                pthread_mutex_lock(&self._watch.lock)
                self._watch.stop = True
                pthread_cond_signal(&self._watch.wake)
                pthread_mutex_unlock(&self._watch.lock)
                with nogil:
                    pthread_join(self._watch.thread, NULL)
                _watch_free(self._watch)
                self._watch = NULL
            if self._backend == BACKEND_NPU and self._reporter is not None:
                for i in range(self._subscribed.size()):
                    with nogil:
                        self._reporter._unsubscribe(self._subscribed[i], self._acl_ctx)
                self._subscribed.clear()
            if self._state != NULL:
                if drained:
                    _state_free(self._state)
                    if self._retained:
                        self._retained = False
                        self._cuda._release(self._device)
                else:
                    # A host function may still run: it needs the state and the queue (and the context).
                    Py_INCREF(self._queue)
                    _warnings.warn(f"StreamNotifier closed with {_state_pending(self._state)} notification(s) the "
                                   "device has not reached; their bookkeeping is leaked", ResourceWarning)
                self._state = NULL
        finally:
            if self._counted:
                _uncount("StreamNotifier")
                _mark_closed(&self._counted, False)
        return drained


# --------------------------------------------------------------------------
# HostStream: the host backend's stream

cdef pthread_mutex_t _event_lock
cdef pthread_cond_t _event_cond
pthread_mutex_init(&_event_lock, NULL)
pthread_cond_init(&_event_cond, NULL)


cdef void _after_fork_child() noexcept nogil:
    # In a forked child, the only thread: the parent's threads are gone and a lock one of them held at the
    # fork would stay held. The objects the parent made see a new process id (and only let go); the global
    # locks of host events, shared by every stream, and of close() calls waiting for one another are made
    # anew for the objects this process makes.
    global _pid, _generation
    _generation += 1
    _pid = getpid()
    pthread_mutex_init(&_event_lock, NULL)
    pthread_cond_init(&_event_cond, NULL)
    pthread_mutex_init(&_close_lock, NULL)
    pthread_cond_init(&_close_cond, NULL)


pthread_atfork(NULL, NULL, _after_fork_child)


cdef HostEvent *_event_new(int refs) noexcept nogil:
    cdef HostEvent *ev = new HostEvent()
    ev.done = False
    ev.refs = refs
    return ev


cdef void _event_unref(HostEvent *ev) noexcept nogil:
    # Called with _event_lock held.
    ev.refs -= 1
    if ev.refs == 0:
        del ev


cdef void *_host_stream_main(void *arg) noexcept nogil:
    (<HostStream>arg)._run()
    return NULL


cdef class HostGate:
    """Test aid: a point in a :class:`HostStream` it does not pass until :meth:`open` (or the stream closes)."""

    cdef HostEvent *_event
    cdef int _made_by

    def __cinit__(self):
        self._made_by = _generation
        self._event = NULL

    def __dealloc__(self):
        if self._event != NULL and _foreign(self._made_by):
            self._event = NULL  # a parent's gate: its stream is the parent's; the event is let go of
        if self._event != NULL:
            pthread_mutex_lock(&_event_lock)
            self._event.done = True
            pthread_cond_broadcast(&_event_cond)
            _event_unref(self._event)
            pthread_mutex_unlock(&_event_lock)
            self._event = NULL

    def open(self):
        _check_here("HostGate", self._made_by)
        if self._event != NULL:
            pthread_mutex_lock(&_event_lock)
            self._event.done = True
            pthread_cond_broadcast(&_event_cond)
            pthread_mutex_unlock(&_event_lock)


cdef class HostStream:
    """The host backend's stream: an ordered queue of native copies run by one thread of its own.

    What a device stream is to the CUDA and Ascend backends: work enqueued on
    it runs in order and asynchronously (:meth:`enqueue_copies` returns at
    once), :meth:`wait_stream` orders it after another stream's work so far,
    and a :class:`StreamNotifier` opened with backend ``"host"`` posts its
    record once the stream reaches it. No device is involved: device caches
    of the host backend live in host memory, so CI runs every device path
    (staging, layer-wise, failure paths) without a GPU.
    """

    def __cinit__(self):
        self._made_by = _generation
        pthread_mutex_init(&self._lock, NULL)
        pthread_cond_init(&self._cond, NULL)
        self._stop = False
        self._enqueued = 0
        self._done = 0
        if pthread_create(&self._thread, NULL, _host_stream_main, <void *>self) != 0:
            pthread_cond_destroy(&self._cond)
            pthread_mutex_destroy(&self._lock)
            raise OSError(EIO, "could not start a host stream thread")
        self._started = True
        self._counted = True
        _live["HostStream"] += 1
        _host_streams[<size_t><void *>self] = self

    def __dealloc__(self):
        if self._started:
            self._close()
        if not _foreign(self._made_by):  # in a forked child the parent's thread may wait on them: leaked
            pthread_cond_destroy(&self._cond)
            pthread_mutex_destroy(&self._lock)

    @property
    def handle(self):
        """The stream's handle, as :meth:`StreamNotifier.notify` takes it."""
        return <size_t><void *>self

    cdef void _run(self) noexcept nogil:
        cdef HostOp *op
        cdef void *slot
        cdef size_t i
        while True:
            pthread_mutex_lock(&self._lock)
            while self._ops.empty() and not self._stop:
                pthread_cond_wait(&self._cond, &self._lock)
            if self._ops.empty():
                pthread_mutex_unlock(&self._lock)
                return
            op = self._ops.front()
            if op.kind == OP_FIRE:
                # Counted done before it fires: whoever its record wakes sees pending() without it.
                slot = op.slot
                self._ops.pop_front()
                self._done += 1
                pthread_cond_broadcast(&self._cond)
                pthread_mutex_unlock(&self._lock)
                del op
                _notify_fire(slot)
                continue
            pthread_mutex_unlock(&self._lock)
            if op.kind == OP_COPY:
                for i in range(op.segs.size()):
                    memcpy(<void *>op.segs[i].dst, <const void *>op.segs[i].src, op.segs[i].nbytes)
            elif op.kind == OP_SIGNAL:
                pthread_mutex_lock(&_event_lock)
                op.event.done = True
                pthread_cond_broadcast(&_event_cond)
                _event_unref(op.event)
                pthread_mutex_unlock(&_event_lock)
            elif op.kind == OP_WAIT:
                pthread_mutex_lock(&_event_lock)
                while not op.event.done and not (<volatile bint>self._stop):
                    pthread_cond_wait(&_event_cond, &_event_lock)
                _event_unref(op.event)
                pthread_mutex_unlock(&_event_lock)
            pthread_mutex_lock(&self._lock)
            self._ops.pop_front()
            self._done += 1
            pthread_cond_broadcast(&self._cond)
            pthread_mutex_unlock(&self._lock)
            del op

    cdef int _push(self, HostOp *op) except -1:
        _check_here("HostStream", self._made_by)
        pthread_mutex_lock(&self._lock)
        if self._stop:
            pthread_mutex_unlock(&self._lock)
            raise OSError(EIO, "the host stream is closed")
        self._ops.push_back(op)
        self._enqueued += 1
        pthread_cond_broadcast(&self._cond)
        pthread_mutex_unlock(&self._lock)
        return 0

    def enqueue_copies(self, const uint64_t[::1] dsts not None, const uint64_t[::1] srcs not None,
                       const uint64_t[::1] sizes not None):
        """Enqueue ``memcpy(dsts[i], srcs[i], sizes[i])`` for every i, after all earlier work; returns the bytes.

        Every address must stay valid until the stream passes the copies.
        """
        cdef size_t n = dsts.shape[0], i
        cdef uint64_t total = 0
        cdef HostOp *op
        cdef CopySeg seg
        if srcs.shape[0] != n or sizes.shape[0] != n:
            raise ValueError("dsts, srcs and sizes must have one entry per copy")
        op = new HostOp()
        op.kind = OP_COPY
        for i in range(n):
            seg.dst = dsts[i]
            seg.src = srcs[i]
            seg.nbytes = sizes[i]
            total += sizes[i]
            op.segs.push_back(seg)
        try:
            self._push(op)
        except BaseException:
            del op
            raise
        return total

    def wait_stream(self, HostStream other not None):
        """Order everything enqueued here from now on after all work enqueued on ``other`` so far."""
        cdef HostOp *signal
        cdef HostOp *wait
        cdef HostEvent *ev
        _check_here("HostStream", self._made_by)
        _check_here("HostStream", other._made_by)
        if other is self:
            return
        ev = _event_new(2)
        signal = new HostOp()
        signal.kind = OP_SIGNAL
        signal.event = ev
        wait = new HostOp()
        wait.kind = OP_WAIT
        wait.event = ev
        try:
            other._push(signal)
        except BaseException:
            del signal
            del wait
            del ev
            raise
        try:
            self._push(wait)
        except BaseException:
            del wait
            pthread_mutex_lock(&_event_lock)
            _event_unref(ev)
            pthread_mutex_unlock(&_event_lock)
            raise

    def gate(self):
        """Test aid: hold the stream at this point until the returned :class:`HostGate` is opened."""
        cdef HostOp *wait
        cdef HostEvent *ev
        cdef HostGate gate
        _check_here("HostStream", self._made_by)
        gate = HostGate.__new__(HostGate)
        ev = _event_new(2)
        wait = new HostOp()
        wait.kind = OP_WAIT
        wait.event = ev
        try:
            self._push(wait)
        except BaseException:
            del wait
            del ev
            raise
        gate._event = ev
        return gate

    def pending(self):
        """Operations enqueued and not finished yet."""
        _check_here("HostStream", self._made_by)
        return self._enqueued - self._done

    def synchronize(self, double timeout=30.0):
        """Block until everything enqueued so far is done; False if ``timeout`` passed first.

        A negative ``timeout`` has passed already and an infinite one has no bound; NaN raises ValueError.
        """
        cdef uint64_t target
        cdef timespec deadline
        cdef bint ok = True
        _check_here("HostStream", self._made_by)
        _check_timeout(timeout)
        pthread_mutex_lock(&self._lock)
        target = self._enqueued
        pthread_mutex_unlock(&self._lock)
        _deadline_in(&deadline, _wait_ms(timeout))
        with nogil:
            pthread_mutex_lock(&self._lock)
            while self._done < target:
                if pthread_cond_timedwait(&self._cond, &self._lock, &deadline) != 0:
                    ok = self._done >= target  # ETIMEDOUT (any other error would come back at once every time)
                    break
            pthread_mutex_unlock(&self._lock)
        return ok

    def close(self):
        """Run what is enqueued (waits on gates and other streams are released), then stop. Idempotent; a
        close() while another thread closes the stream returns once that one has finished."""
        if self._started or (self._counted and _foreign(self._made_by)):
            self._close()
        elif self._counted:
            with nogil:
                pthread_mutex_lock(&_close_lock)
                while self._counted:
                    pthread_cond_wait(&_close_cond, &_close_lock)
                pthread_mutex_unlock(&_close_lock)

    cdef _close(self):
        # Claimed with the GIL held, before the join lets it go: a concurrent close() waits (see close)
        # instead of joining the thread a second time. _counted is cleared once it is over.
        self._started = False
        if _foreign(self._made_by):
            # A forked child: the stream's thread is the parent's (nothing to wake or join here) and may have
            # held the lock at the fork; the queued operations are let go of, not freed.
            self._stop = True
            aio_forget(self._ops)
        else:
            pthread_mutex_lock(&self._lock)
            self._stop = True
            pthread_cond_broadcast(&self._cond)
            pthread_mutex_unlock(&self._lock)
            pthread_mutex_lock(&_event_lock)
            pthread_cond_broadcast(&_event_cond)
            pthread_mutex_unlock(&_event_lock)
            with nogil:
                pthread_join(self._thread, NULL)
        # At interpreter exit (a stream never closed) the module's globals may already be None.
        if _host_streams is not None:
            _host_streams.pop(<size_t><void *>self, None)
        if self._counted:
            _uncount("HostStream")
            _mark_closed(&self._counted, False)


cdef void *_line_fire_main(void *arg) noexcept nogil:
    cdef vector[NotifySlot *] *batch = <vector[NotifySlot *] *>arg
    cdef size_t i
    for i in range(batch.size()):
        _notify_fire(<void *>deref(batch)[i])
    return NULL


cdef class _HostFnLine:
    """Test-only: the host-function half of :class:`StreamNotifier`, with no device.

    It shares the notifier's bookkeeping and its host function body
    (``_notify_fire``); :meth:`fire` runs the bodies of the oldest entries,
    in order, on a plain native thread without the GIL, where a driver would
    run them when its stream reaches them. The library never uses it.
    """

    def __cinit__(self, CompletionQueue queue not None):
        self._made_by = _generation
        queue._check_open()
        self._queue = queue
        self._state = _state_new(queue)
        self._counted = True
        _live["_HostFnLine"] += 1

    def __dealloc__(self):
        if self._counted:
            self.close()

    def enqueue(self, uint64_t token, int64_t aux=0):
        _check_here("_HostFnLine", self._made_by)
        if self._state == NULL:
            raise ValueError("_HostFnLine is closed")
        self._line.push_back(_state_arm(self._state, token, aux))

    def cancel(self, uint64_t token):
        _check_here("_HostFnLine", self._made_by)
        if self._state == NULL:
            return False
        return _state_cancel(self._state, token)

    def pending(self):
        _check_here("_HostFnLine", self._made_by)
        if self._state == NULL:
            return 0
        return _state_pending(self._state)

    def fire(self, size_t count):
        """Run the host functions of the ``count`` oldest entries on a native thread; returns how many ran."""
        cdef vector[NotifySlot *] batch
        cdef pthread_t tid
        _check_here("_HostFnLine", self._made_by)
        while batch.size() < count and not self._line.empty():
            batch.push_back(self._line.front())
            self._line.pop_front()
        if batch.empty():
            return 0
        with nogil:
            if pthread_create(&tid, NULL, _line_fire_main, <void *>&batch) == 0:
                pthread_join(tid, NULL)
            else:
                _line_fire_main(<void *>&batch)
        return batch.size()

    def close(self):
        """Fire whatever is left (as a stream finishing its work would), then release."""
        if not self._counted:
            return
        if _foreign(self._made_by):
            # A forked child: the records would go to the parent's queue and its lock may be held; the
            # entries and the bookkeeping are let go of.
            self._line.clear()
        else:
            self.fire(self._line.size())
            _state_drain(self._state, 0.0)
            _state_free(self._state)
        self._state = NULL
        self._counted = False
        _uncount("_HostFnLine")
