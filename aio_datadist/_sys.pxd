# C declarations the core needs that Cython's bundled .pxd files do not cover.

from libc.stdint cimport uint32_t, uint64_t

cdef extern from "<sys/eventfd.h>" nogil:
    int eventfd(unsigned int initval, int flags)
    int EFD_NONBLOCK
    int EFD_CLOEXEC

cdef extern from "<sys/epoll.h>" nogil:
    union epoll_data_t:
        void *ptr
        int fd
        uint32_t u32
        uint64_t u64

    struct epoll_event:
        uint32_t events
        epoll_data_t data

    int epoll_create1(int flags)
    int epoll_ctl(int epfd, int op, int fd, epoll_event *event)
    int epoll_wait(int epfd, epoll_event *events, int maxevents, int timeout)
    int EPOLL_CLOEXEC
    int EPOLL_CTL_ADD
    int EPOLL_CTL_MOD
    int EPOLL_CTL_DEL
    uint32_t EPOLLIN
    uint32_t EPOLLOUT
    uint32_t EPOLLERR
    uint32_t EPOLLHUP
    uint32_t EPOLLRDHUP

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    ctypedef struct pthread_mutex_t:
        pass
    ctypedef struct pthread_cond_t:
        pass
    int pthread_create(pthread_t *thread, const void *attr,
                       void *(*start)(void *) noexcept nogil, void *arg)
    int pthread_join(pthread_t thread, void **retval)
    int pthread_mutex_init(pthread_mutex_t *m, const void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *m)
    int pthread_mutex_lock(pthread_mutex_t *m)
    int pthread_mutex_unlock(pthread_mutex_t *m)
    int pthread_cond_init(pthread_cond_t *c, const void *attr)
    int pthread_cond_destroy(pthread_cond_t *c)
    int pthread_cond_wait(pthread_cond_t *c, pthread_mutex_t *m)
    int pthread_cond_signal(pthread_cond_t *c)
    int pthread_cond_broadcast(pthread_cond_t *c)

cdef extern from "<unistd.h>" nogil:
    ssize_t read(int fd, void *buf, size_t count)
    ssize_t write(int fd, const void *buf, size_t count)
    int close(int fd)
    int getpid()

cdef extern from "<limits.h>" nogil:
    int IOV_MAX

cdef extern from "<errno.h>" nogil:
    int ECANCELED
    int ECONNRESET

cdef extern from "<dlfcn.h>" nogil:
    void *dlopen(const char *filename, int flags)
    void *dlsym(void *handle, const char *symbol)
    char *dlerror()
    int RTLD_NOW
    int RTLD_LOCAL

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int clock_gettime(int clk_id, timespec *tp)
    int CLOCK_REALTIME
    int CLOCK_MONOTONIC

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "<pthread.h>" nogil:
    int pthread_cond_timedwait(pthread_cond_t *c, pthread_mutex_t *m, const timespec *abstime)
    int pthread_atfork(void (*prepare)() noexcept nogil, void (*parent)() noexcept nogil,
                       void (*child)() noexcept nogil)

cdef extern from "<errno.h>" nogil:
    int ENODEV
    int EIO
    int ETIMEDOUT

cdef extern from "<sys/socket.h>" nogil:
    int setsockopt(int fd, int level, int optname, const void *optval, unsigned int optlen)
    int SOL_SOCKET
    int SO_RCVLOWAT
