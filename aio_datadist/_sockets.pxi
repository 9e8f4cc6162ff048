# _sockets.pxi: included by _core.pyx (one module; each .pxi holds one part of it).
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
        cdef int rc
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
        rc = pthread_create(&self._thread, NULL, _io_main, <void *>self)
        if rc != 0:
            self._release_fds()
            raise OSError(rc, f"could not start the socket thread: {_os.strerror(rc)}")
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
