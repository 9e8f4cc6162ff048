# A host copy that writes around the CPU caches: non-temporal (streaming) stores for the destination.
#
# A KV copy's destination is not read by this core soon after (the bytes go to a device, or wait for a
# later decode step), and its source is usually cold too. An ordinary copy first reads every destination
# line into the cache it then overwrites (a read for ownership) and evicts the interpreter's working set
# on the way; streaming stores skip both. Measured on a 2-core VM (benchmarks/RESULTS.md, "streaming
# stores"): 14-24 % less time for cold copies of 64 KiB to 128 MiB; a hot 2 MiB 0.89x, a hot 8 MiB 1.08x;
# an ordinary copy stays about twice as fast for hot copies of 1 MiB or less, which is why the core uses
# this one only for jobs from ``stream_copy_min`` bytes on (``_core.set_stream_copy_min``).
#
# Streaming stores are weakly ordered: the ``sfence`` at the end makes every store visible to other threads
# before the call returns, so a copy thread that then posts its job's record (or a cancelled job's end) has
# written all it will write. Without SSE2 (not x86-64) it is memcpy.

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #endif

    static inline void aio_stream_copy(void *dst_, const void *src_, size_t n) {
    #if defined(__SSE2__)
        char *dst = (char *)dst_;
        const char *src = (const char *)src_;
        size_t head = (size_t)(-(uintptr_t)dst) & 63;  /* bytes to the destination's next 64-byte line */
        if (n < head + 256) {
            memcpy(dst, src, n);
            return;
        }
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        size_t body = n & ~(size_t)63;
        for (size_t i = 0; i < body; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_stream_si128((__m128i *)(dst + i), a);
            _mm_stream_si128((__m128i *)(dst + i + 16), b);
            _mm_stream_si128((__m128i *)(dst + i + 32), c);
            _mm_stream_si128((__m128i *)(dst + i + 48), d);
        }
        memcpy(dst + body, src + body, n - body);
        _mm_sfence();
    #else
        memcpy(dst_, src_, n);
    #endif
    }
    """
    void aio_stream_copy(void *dst, const void *src, size_t n) nogil
