# _segments.pxi: included by _core.pyx (one module; each .pxi holds one part of it).
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
