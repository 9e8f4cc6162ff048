# _stream_notifier.pxi: included by _core.pyx (one module; each .pxi holds one part of it).
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
