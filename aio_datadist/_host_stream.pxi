# _host_stream.pxi: included by _core.pyx (one module; each .pxi holds one part of it).
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
