# _completions.pxi: included by _core.pyx (one module; each .pxi holds one part of it).
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
