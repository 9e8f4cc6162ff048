# Declarations of the native core. Bodies live in _core.pyx.

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libcpp.vector cimport vector
from libcpp.deque cimport deque
from libcpp.unordered_map cimport unordered_map
from posix.uio cimport iovec

from aio_datadist._sys cimport pthread_t, pthread_mutex_t, pthread_cond_t


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


cdef cppclass FdState:
    deque[IoJob *] sends
    deque[IoJob *] recvs
    uint32_t interest


cdef struct IoCommand:
    int kind
    IoJob *job
    uint64_t token
    int fd


cdef class CompletionQueue:
    cdef int _efd
    cdef bint _closed
    cdef bint _counted
    cdef pthread_mutex_t _lock
    cdef vector[Record] _records
    cdef void push(self, uint64_t token, int32_t status, int64_t aux) noexcept nogil
    cdef _shutdown(self)
    cdef _check_open(self)


cdef class HostCopyEngine:
    cdef CompletionQueue _queue
    cdef pthread_mutex_t _lock
    cdef pthread_cond_t _cond
    cdef deque[CopyChunk] _chunks
    cdef unordered_map[uint64_t, CopyJob *] _jobs
    cdef vector[pthread_t] _threads
    cdef bint _stop
    cdef bint _closed
    cdef bint _counted
    cdef uint64_t _split_bytes
    cdef void _work(self) noexcept nogil
    cdef void _split(self, CopyJob *job, uint64_t chunk_bytes) noexcept nogil
    cdef _shutdown(self)


cdef class SocketEngine:
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
    cdef _release_fds(self)
    cdef _shutdown(self)
