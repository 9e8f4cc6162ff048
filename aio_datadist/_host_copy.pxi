# _host_copy.pxi: included by _core.pyx (one module; each .pxi holds one part of it).
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
        cdef int i, rc
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
            rc = pthread_create(&tid, NULL, _copy_worker_main, <void *>self)
            if rc != 0:
                self._shutdown()
                raise OSError(rc, f"could not start a copy thread: {_os.strerror(rc)}")
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
        _check_here("HostCopyEngine", self._made_by)  # a forked child: the lock may be held by a thread it lacks
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
