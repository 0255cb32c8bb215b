/* SHA-256 (FIPS 180-4) of one buffer, for the table digest's 64-bit hashes
 * (cdc_platform/wire/digest.py). Bundled rather than linked: a fresh machine building the
 * twins has a C compiler but not necessarily OpenSSL's headers, and the digest hashes short
 * messages (a row's canonical bytes, ~100-300 bytes), where a call through hashlib costs more
 * than the hash. On x86-64 CPUs with the SHA extensions (checked once with CPUID) the blocks
 * go through the SHA-NI instructions, as OpenSSL's do; elsewhere through portable C. */

#ifndef CDC_SHA256_H
#define CDC_SHA256_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static const uint32_t cdc_sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

#define CDC_ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void cdc_sha256_blocks_portable(uint32_t state[8], const unsigned char *data,
                                       size_t blocks) {
    uint32_t w[64];
    while (blocks--) {
        uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
        uint32_t e = state[4], f = state[5], g = state[6], h = state[7];
        int t;
        for (t = 0; t < 16; t++, data += 4)
            w[t] = (uint32_t)data[0] << 24 | (uint32_t)data[1] << 16 |
                   (uint32_t)data[2] << 8 | (uint32_t)data[3];
        for (t = 16; t < 64; t++) {
            uint32_t s0 = CDC_ROTR(w[t - 15], 7) ^ CDC_ROTR(w[t - 15], 18) ^ (w[t - 15] >> 3);
            uint32_t s1 = CDC_ROTR(w[t - 2], 17) ^ CDC_ROTR(w[t - 2], 19) ^ (w[t - 2] >> 10);
            w[t] = w[t - 16] + s0 + w[t - 7] + s1;
        }
        for (t = 0; t < 64; t++) {
            uint32_t t1 = h + (CDC_ROTR(e, 6) ^ CDC_ROTR(e, 11) ^ CDC_ROTR(e, 25)) +
                          ((e & f) ^ (~e & g)) + cdc_sha256_k[t] + w[t];
            uint32_t t2 = (CDC_ROTR(a, 2) ^ CDC_ROTR(a, 13) ^ CDC_ROTR(a, 22)) +
                          ((a & b) ^ (a & c) ^ (b & c));
            h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
        }
        state[0] += a; state[1] += b; state[2] += c; state[3] += d;
        state[4] += e; state[5] += f; state[6] += g; state[7] += h;
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CDC_SHA256_SHANI 1
#include <cpuid.h>
#include <immintrin.h>

/* The blocks with the SHA extensions: the state held as ABEF/CDGH, four rounds a step, the
 * message schedule by sha256msg1/msg2 (Intel's "SHA extensions" white paper). The steps: */
#define CDC_SHA256_SHANI_TARGET __attribute__((target("sha,sse4.1,ssse3")))
#if defined(__clang__)
#define CDC_SHA256_UNROLL _Pragma("unroll")
#else
#define CDC_SHA256_UNROLL _Pragma("GCC unroll 16")
#endif

/* state[8] (a..h) into the ABEF/CDGH registers */
CDC_SHA256_SHANI_TARGET
static inline void cdc_sha256_shani_load(const uint32_t state[8], __m128i *abef,
                                         __m128i *cdgh) {
    __m128i cdab = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&state[0]), 0xB1);
    __m128i efgh = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&state[4]), 0x1B);
    *abef = _mm_alignr_epi8(cdab, efgh, 8);
    *cdgh = _mm_blend_epi16(efgh, cdab, 0xF0);
}

/* ... and back */
CDC_SHA256_SHANI_TARGET
static inline void cdc_sha256_shani_store(uint32_t state[8], __m128i abef, __m128i cdgh) {
    __m128i feba = _mm_shuffle_epi32(abef, 0x1B), dchg = _mm_shuffle_epi32(cdgh, 0xB1);
    _mm_storeu_si128((__m128i *)&state[0], _mm_blend_epi16(feba, dchg, 0xF0)); /* DCBA */
    _mm_storeu_si128((__m128i *)&state[4], _mm_alignr_epi8(dchg, feba, 8));     /* HGFE */
}

/* The block's message words ``4 * group`` to ``4 * group + 3`` (its own for the first four
 * groups, then from the 16 before: ``words`` holds the last four groups), kept in ``words``. */
CDC_SHA256_SHANI_TARGET
static inline __m128i cdc_sha256_shani_words(__m128i words[4], int group,
                                             const unsigned char *block) {
    const __m128i byteswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
    __m128i *next = &words[group & 3];
    if (group < 4)
        *next = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(block + 16 * group)),
                                 byteswap);
    else
        *next = _mm_sha256msg2_epu32(
            _mm_add_epi32(_mm_sha256msg1_epu32(*next, words[(group + 1) & 3]),
                          _mm_alignr_epi8(words[(group + 3) & 3], words[(group + 2) & 3], 4)),
            words[(group + 3) & 3]);
    return *next;
}

/* Rounds ``4 * group`` to ``4 * group + 3`` with those words. */
CDC_SHA256_SHANI_TARGET
static inline void cdc_sha256_shani_rounds(__m128i *abef, __m128i *cdgh, __m128i words,
                                           int group) {
    __m128i sum =
        _mm_add_epi32(words, _mm_loadu_si128((const __m128i *)&cdc_sha256_k[4 * group]));
    *cdgh = _mm_sha256rnds2_epu32(*cdgh, *abef, sum);
    *abef = _mm_sha256rnds2_epu32(*abef, *cdgh, _mm_shuffle_epi32(sum, 0x0E));
}

CDC_SHA256_SHANI_TARGET
static void cdc_sha256_blocks_shani(uint32_t state[8], const unsigned char *data,
                                    size_t blocks) {
    __m128i abef, cdgh;
    cdc_sha256_shani_load(state, &abef, &cdgh);
    for (; blocks; blocks--, data += 64) {
        __m128i abef_saved = abef, cdgh_saved = cdgh, words[4];
        int group;
        CDC_SHA256_UNROLL
        for (group = 0; group < 16; group++)
            cdc_sha256_shani_rounds(&abef, &cdgh, cdc_sha256_shani_words(words, group, data),
                                    group);
        abef = _mm_add_epi32(abef, abef_saved);
        cdgh = _mm_add_epi32(cdgh, cdgh_saved);
    }
    cdc_sha256_shani_store(state, abef, cdgh);
}

/* Two messages' blocks at once (``blocks`` of each), their rounds interleaved: each
 * sha256rnds2 waits for the one before it in its own message only, so two messages keep
 * the SHA unit busy where one leaves it idle between dependent rounds (measured on this
 * project's AMD EPYC VM: ~21 ns a block each instead of ~41). */
CDC_SHA256_SHANI_TARGET
static void cdc_sha256_blocks_shani_pair(uint32_t first_state[8],
                                         const unsigned char *first_data,
                                         uint32_t second_state[8],
                                         const unsigned char *second_data, size_t blocks) {
    __m128i abef1, cdgh1, abef2, cdgh2;
    cdc_sha256_shani_load(first_state, &abef1, &cdgh1);
    cdc_sha256_shani_load(second_state, &abef2, &cdgh2);
    for (; blocks; blocks--, first_data += 64, second_data += 64) {
        __m128i abef1_saved = abef1, cdgh1_saved = cdgh1, words1[4];
        __m128i abef2_saved = abef2, cdgh2_saved = cdgh2, words2[4];
        int group;
        CDC_SHA256_UNROLL
        for (group = 0; group < 16; group++) {
            __m128i next1 = cdc_sha256_shani_words(words1, group, first_data);
            __m128i next2 = cdc_sha256_shani_words(words2, group, second_data);
            cdc_sha256_shani_rounds(&abef1, &cdgh1, next1, group);
            cdc_sha256_shani_rounds(&abef2, &cdgh2, next2, group);
        }
        abef1 = _mm_add_epi32(abef1, abef1_saved);
        cdgh1 = _mm_add_epi32(cdgh1, cdgh1_saved);
        abef2 = _mm_add_epi32(abef2, abef2_saved);
        cdgh2 = _mm_add_epi32(cdgh2, cdgh2_saved);
    }
    cdc_sha256_shani_store(first_state, abef1, cdgh1);
    cdc_sha256_shani_store(second_state, abef2, cdgh2);
}

static int cdc_sha256_has_shani(void) {
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx & bit_SSE4_1) || !(ecx & bit_SSSE3))
        return 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx))
        return 0;
    return (ebx >> 29) & 1; /* CPUID.(EAX=7,ECX=0):EBX.SHA */
}
#endif

typedef void (*cdc_sha256_blocks_fn)(uint32_t *, const unsigned char *, size_t);
static cdc_sha256_blocks_fn cdc_sha256_blocks = NULL;

/* Which implementation this CPU runs ("sha-ni" or "portable"), chosen on first use. */
static const char *cdc_sha256_implementation(void) {
    if (cdc_sha256_blocks == NULL) {
        cdc_sha256_blocks = cdc_sha256_blocks_portable;
#ifdef CDC_SHA256_SHANI
        if (cdc_sha256_has_shani())
            cdc_sha256_blocks = cdc_sha256_blocks_shani;
#endif
    }
#ifdef CDC_SHA256_SHANI
    if (cdc_sha256_blocks == cdc_sha256_blocks_shani)
        return "sha-ni";
#endif
    return "portable";
}

#define CDC_SHA256_INITIAL {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, \
                            0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19}

/* The last one or two blocks of a message of ``size`` bytes: its bytes past the whole blocks,
 * the 0x80, zeros and the length in bits; how many blocks. */
static size_t cdc_sha256_tail(unsigned char tail[128], const unsigned char *data, size_t size) {
    size_t whole = size / 64, rest = size % 64, padded = rest < 56 ? 64 : 128;
    uint64_t bits = (uint64_t)size * 8;
    int i;
    memcpy(tail, data + whole * 64, rest);
    tail[rest] = 0x80;
    memset(tail + rest + 1, 0, padded - rest - 1 - 8);
    for (i = 0; i < 8; i++)
        tail[padded - 1 - i] = (unsigned char)(bits >> (8 * i));
    return padded / 64;
}

/* The first 8 bytes of SHA-256(data[0..size)) as a big-endian integer. */
static uint64_t cdc_sha256_head64(const unsigned char *data, size_t size) {
    uint32_t state[8] = CDC_SHA256_INITIAL;
    unsigned char tail[128];
    size_t whole = size / 64, tail_blocks = cdc_sha256_tail(tail, data, size);
    if (cdc_sha256_blocks == NULL)
        cdc_sha256_implementation();
    if (whole)
        cdc_sha256_blocks(state, data, whole);
    cdc_sha256_blocks(state, tail, tail_blocks);
    return (uint64_t)state[0] << 32 | state[1];
}

/* The message whole and padded into ``padded`` (its size rounded up to 64, plus up to 128),
 * so that its blocks follow in one run; how many blocks. */
static size_t cdc_sha256_padded(unsigned char *padded, const unsigned char *data,
                                size_t size) {
    size_t whole = size / 64 * 64;
    memcpy(padded, data, whole);
    return size / 64 + cdc_sha256_tail(padded + whole, data, size);
}

/* The largest message cdc_sha256_head64_pair pads on its stack (a row's canonical bytes are
 * ~100-300 bytes); longer ones are hashed one after the other. */
#define CDC_SHA256_PAIR_MAX 1024

/* cdc_sha256_head64 of two messages, ``first_hash`` and ``second_hash``: on SHA-NI the blocks
 * they have in common are hashed together (cdc_sha256_blocks_shani_pair), the longer one's
 * rest alone. */
static inline void cdc_sha256_head64_pair(const unsigned char *first, size_t first_size,
                                          const unsigned char *second, size_t second_size,
                                          uint64_t *first_hash, uint64_t *second_hash) {
#ifdef CDC_SHA256_SHANI
    uint32_t first_state[8] = CDC_SHA256_INITIAL, second_state[8] = CDC_SHA256_INITIAL;
    unsigned char first_padded[CDC_SHA256_PAIR_MAX + 128];
    unsigned char second_padded[CDC_SHA256_PAIR_MAX + 128];
    size_t first_blocks, second_blocks, common;
    if (cdc_sha256_blocks == NULL)
        cdc_sha256_implementation();
    if (cdc_sha256_blocks == cdc_sha256_blocks_shani && first_size <= CDC_SHA256_PAIR_MAX &&
            second_size <= CDC_SHA256_PAIR_MAX) {
        first_blocks = cdc_sha256_padded(first_padded, first, first_size);
        second_blocks = cdc_sha256_padded(second_padded, second, second_size);
        common = first_blocks < second_blocks ? first_blocks : second_blocks;
        cdc_sha256_blocks_shani_pair(first_state, first_padded, second_state, second_padded,
                                     common);
        if (first_blocks > common)
            cdc_sha256_blocks_shani(first_state, first_padded + 64 * common,
                                    first_blocks - common);
        if (second_blocks > common)
            cdc_sha256_blocks_shani(second_state, second_padded + 64 * common,
                                    second_blocks - common);
        *first_hash = (uint64_t)first_state[0] << 32 | first_state[1];
        *second_hash = (uint64_t)second_state[0] << 32 | second_state[1];
        return;
    }
#endif
    *first_hash = cdc_sha256_head64(first, first_size);
    *second_hash = cdc_sha256_head64(second, second_size);
}

#endif
