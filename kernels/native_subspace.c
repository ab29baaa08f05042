/* Attention over a subspace archive (the tiered cache's archive coded in fitted per-head bases, `native_subspace.py`)
 * from its packed codes on the CPU. A key is rebuilt from its coefficients, key = mean + z @ W (W: the basis times
 * sigma, [rank, D]), RoPE put back with the cos / sin of its position (pre-RoPE keys), and dotted with the query rows
 * while it sits in L1; a value's coefficients are weighted by the probabilities without leaving the whitened basis
 * (the caller multiplies the sums by sigma and the basis once). With AVX-512F, four keys of a head dim that is a
 * multiple of 64 are rebuilt with their sums in registers and dotted with intrinsics (`rebuild_keys4_avx`): the same
 * arithmetic in another order, so the scores differ from the portable loops' in the last bits. */

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include "fp16_bits.h"
/* AVX-512 VBMI reads a row's codes with one byte permutation (`row_codes`); -DHF_KVCACHE_SCALAR_CODES, or a CPU
 * without it, reads them a subspace at a time (`codes_of`): the same integers either way. */
#if defined(__AVX512VBMI__) && defined(__AVX512BW__) && !defined(HF_KVCACHE_SCALAR_CODES)
#define FAST_CODES 1
#include <immintrin.h>
#endif
/* AVX-512F rebuilds four keys in 64-channel blocks with their sums in registers (`rebuild_keys4_avx`, head dims that
 * are multiples of 64), in either build of the codes. */
#if defined(__AVX512F__)
#define FAST_KEYS 1
#include <immintrin.h>
#endif

/* a masked score: exp gives exactly 0 without the infinities that -ffast-math excludes */
#define NEG (-3.0e38f)

#define TILE 32
#define MAXDIM 256
#define MAXROWS 16

/* key[0:2 half] turned by RoPE (rotate_half layout) with the cos / sin [half] of its position. */
static inline void turn(float *key, const float *cos_t, const float *sin_t, const int half) {
#pragma omp simd
    for (int i = 0; i < half; i++) {
        const float x1 = key[i], x2 = key[i + half];
        key[i] = x1 * cos_t[i] - x2 * sin_t[i];
        key[i + half] = x2 * cos_t[i] + x1 * sin_t[i];
    }
}

/* key[0:dim] = mean + sum_j z[j] w[j, :], then turned by RoPE (cos_t / sin_t: [dim / 2], or NULL: no RoPE). */
static inline void rebuild_key(const float *z, const float *w, const float *mean, const float *cos_t,
                               const float *sin_t, int rank, const int dim, float *key) {
    for (int d = 0; d < dim; d++) key[d] = mean[d];
    for (int j = 0; j < rank; j++) {
        const float c = z[j];
        const float *wj = w + (long)j * dim;
#pragma omp simd
        for (int d = 0; d < dim; d++) key[d] += c * wj[d];
    }
    if (cos_t) turn(key, cos_t, sin_t, dim / 2);
}

/* rebuild_key for four tokens at once (z and key: four rows of MAXDIM): each row of W loaded once for the four, and
 * four independent sums per channel. */
static inline void rebuild_keys4(float z[4][MAXDIM], const float *w, const float *mean, const float *cos_t,
                                 const float *sin_t, int rank, const int dim, float key[4][MAXDIM]) {
    const int half = dim / 2;
    for (int u = 0; u < 4; u++)
        for (int d = 0; d < dim; d++) key[u][d] = mean[d];
    for (int j = 0; j < rank; j++) {
        const float *wj = w + (long)j * dim;
        const float c0 = z[0][j], c1 = z[1][j], c2 = z[2][j], c3 = z[3][j];
#pragma omp simd
        for (int d = 0; d < dim; d++) {
            const float x = wj[d];
            key[0][d] += c0 * x, key[1][d] += c1 * x, key[2][d] += c2 * x, key[3][d] += c3 * x;
        }
    }
    if (cos_t)
        for (int u = 0; u < 4; u++) turn(key[u], cos_t + (long)u * half, sin_t + (long)u * half, half);
}

#ifdef FAST_KEYS
/* rebuild_keys4 for a head dim that is a multiple of 64: per 64-channel block sixteen accumulators (four keys x four
 * vectors) stay in registers over the directions, each row of W loaded once for the four keys (the empty asm keeps
 * the four loads in registers: folded into the multiply-adds, the compiler loaded each row four times); RoPE after. */
static inline void rebuild_keys4_avx(float z[4][MAXDIM], const float *w, const float *mean, const float *cos_t,
                                     const float *sin_t, int rank, const int dim, float key[4][MAXDIM]) {
    for (int c0 = 0; c0 < dim; c0 += 64) {
        __m512 a[4][4];
        for (int c = 0; c < 4; c++) {
            const __m512 m = _mm512_loadu_ps(mean + c0 + 16 * c);
            for (int u = 0; u < 4; u++) a[u][c] = m;
        }
        for (int j = 0; j < rank; j++) {
            const float *wj = w + (long)j * dim + c0;
            __m512 w0 = _mm512_loadu_ps(wj), w1 = _mm512_loadu_ps(wj + 16), w2 = _mm512_loadu_ps(wj + 32),
                   w3 = _mm512_loadu_ps(wj + 48);
            __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));
            for (int u = 0; u < 4; u++) {
                const __m512 c = _mm512_set1_ps(z[u][j]);
                a[u][0] = _mm512_fmadd_ps(c, w0, a[u][0]), a[u][1] = _mm512_fmadd_ps(c, w1, a[u][1]);
                a[u][2] = _mm512_fmadd_ps(c, w2, a[u][2]), a[u][3] = _mm512_fmadd_ps(c, w3, a[u][3]);
            }
        }
        for (int u = 0; u < 4; u++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(key[u] + c0 + 16 * c, a[u][c]);
    }
    if (!cos_t) return;
    const int half = dim / 2;
    for (int u = 0; u < 4; u++) {
        const float *cu = cos_t + (long)u * half, *su = sin_t + (long)u * half;
        for (int i = 0; i < half; i += 16) {
            const __m512 x1 = _mm512_loadu_ps(key[u] + i), x2 = _mm512_loadu_ps(key[u] + half + i);
            const __m512 c = _mm512_loadu_ps(cu + i), s = _mm512_loadu_ps(su + i);
            _mm512_storeu_ps(key[u] + i, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)));
            _mm512_storeu_ps(key[u] + half + i, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)));
        }
    }
}

/* dots[u][r] = q_r . key[u] for four keys (dim a multiple of 16). */
static inline void dots4_avx(const float *q, int rows, float key[4][MAXDIM], const int dim, float dots[4][MAXROWS]) {
    for (int r = 0; r < rows; r++) {
        const float *qr = q + (long)r * dim;
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int d = 0; d < dim; d += 16) {
            const __m512 x = _mm512_loadu_ps(qr + d);
            s0 = _mm512_fmadd_ps(x, _mm512_loadu_ps(key[0] + d), s0);
            s1 = _mm512_fmadd_ps(x, _mm512_loadu_ps(key[1] + d), s1);
            s2 = _mm512_fmadd_ps(x, _mm512_loadu_ps(key[2] + d), s2);
            s3 = _mm512_fmadd_ps(x, _mm512_loadu_ps(key[3] + d), s3);
        }
        dots[0][r] = _mm512_reduce_add_ps(s0), dots[1][r] = _mm512_reduce_add_ps(s1);
        dots[2][r] = _mm512_reduce_add_ps(s2), dots[3][r] = _mm512_reduce_add_ps(s3);
    }
}
#endif

static inline void tile_scores(const float *z, const float *w, const float *mean, const float *cos_t,
                               const float *sin_t, const float *q, float *out, int tokens, int rank, int rows,
                               int t0, int n, float scale, const int dim) {
    const int half = dim / 2;
    float key[MAXDIM];
    for (int t = t0; t < t0 + n; t++) {
        rebuild_key(z + (long)t * rank, w, mean, cos_t + (long)t * half, sin_t + (long)t * half, rank, dim, key);
        for (int m = 0; m < rows; m++) {
            const float *qm = q + (long)m * dim;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int d = 0; d < dim; d++) acc += qm[d] * key[d];
            out[(long)m * tokens + t] = acc * scale;
        }
    }
}

/* z [bh, tokens, rank], w [heads, rank, dim], mean [heads, dim], cos_t / sin_t [tokens, dim / 2], q [bh, rows, dim]
 * (bh = batch x heads, head = bh % heads), out [bh, rows, tokens]; scale multiplies every score (RoPE's attention
 * scaling). Returns 0, or -1 for a head dim it does not take (odd, or above MAXDIM). */
int subspace_rope_scores(const float *z, const float *w, const float *mean, const float *cos_t, const float *sin_t,
                         const float *q, float *out, int bh, int heads, int tokens, int rank, int dim, int rows,
                         float scale, int threads) {
    if (dim % 2 || dim > MAXDIM) return -1;
    const int tiles = (tokens + TILE - 1) / TILE;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int i = 0; i < bh; i++) {
        for (int k = 0; k < tiles; k++) {
            const int h = i % heads, t0 = k * TILE, n = tokens - t0 < TILE ? tokens - t0 : TILE;
            const float *zi = z + (long)i * tokens * rank, *wh = w + (long)h * rank * dim;
            const float *mh = mean + (long)h * dim, *qi = q + (long)i * rows * dim;
            float *oi = out + (long)i * rows * tokens;
            if (dim == 64)
                tile_scores(zi, wh, mh, cos_t, sin_t, qi, oi, tokens, rank, rows, t0, n, scale, 64);
            else if (dim == 128)
                tile_scores(zi, wh, mh, cos_t, sin_t, qi, oi, tokens, rank, rows, t0, n, scale, 128);
            else if (dim == 256)
                tile_scores(zi, wh, mh, cos_t, sin_t, qi, oi, tokens, rank, rows, t0, n, scale, 256);
            else
                tile_scores(zi, wh, mh, cos_t, sin_t, qi, oi, tokens, rank, rows, t0, n, scale, dim);
        }
    }
    return 0;
}

/* ---- the whole softmax partial from the packed codes ------------------------------------------------------------
 * A subspace's codes sit in its bytes of the token's row, code i at bit bits * i (little-endian; every width of
 * `quant.packing` lays them out so). meta: per subspace (first direction, last + 1, bits, first byte). */

static inline int code_at(const uint8_t *row, int bits, int i) {
    const int pos = bits * i, byte = pos >> 3, shift = pos & 7;
    unsigned v = row[byte];
    if (shift + bits > 8) v |= (unsigned)row[byte + 1] << 8;
    return (int)((v >> shift) & ((1u << bits) - 1));
}

/* Codes as floats: a byte of 1-bit (eight), 2-bit (four) or 4-bit (two) codes, six bits of 3-bit codes (two). */
static float lut1[256][8], lut2[256][4], lut4[256][2], lut3[64][2];
static int lut_ready;

static void fill_luts(void) {
    if (lut_ready) return;
    for (int b = 0; b < 256; b++) {
        for (int k = 0; k < 8; k++) lut1[b][k] = (float)((b >> k) & 1);
        for (int k = 0; k < 4; k++) lut2[b][k] = (float)((b >> (2 * k)) & 3);
        lut4[b][0] = (float)(b & 15), lut4[b][1] = (float)(b >> 4);
        if (b < 64) lut3[b][0] = (float)(b & 7), lut3[b][1] = (float)(b >> 3);
    }
    lut_ready = 1;
}

/* out[0:n] = the n codes of `bits` bits at p (as float); the common widths a byte or a 3-byte word at a time. */
static inline void unpack_run(const uint8_t *p, int bits, int n, float *out) {
    int i = 0;
    if (bits == 1) {
        for (; i + 8 <= n; i += 8, p++) memcpy(out + i, lut1[*p], 8 * sizeof(float));
    } else if (bits == 2) {
        for (; i + 4 <= n; i += 4, p++) memcpy(out + i, lut2[*p], 4 * sizeof(float));
    } else if (bits == 4) {
        for (; i + 2 <= n; i += 2, p++) memcpy(out + i, lut4[*p], 2 * sizeof(float));
    } else if (bits == 3) {
        for (; i + 8 <= n; i += 8, p += 3) {
            const unsigned v = p[0] | (unsigned)p[1] << 8 | (unsigned)p[2] << 16;
            for (int k = 0; k < 4; k++) memcpy(out + i + 2 * k, lut3[(v >> (6 * k)) & 63], 2 * sizeof(float));
        }
    } else if (bits == 6) {
        for (; i + 4 <= n; i += 4, p += 3) {
            const unsigned v = p[0] | (unsigned)p[1] << 8 | (unsigned)p[2] << 16;
            for (int k = 0; k < 4; k++) out[i + k] = (float)((v >> (6 * k)) & 63);
        }
    } else if (bits == 8) {
        for (; i < n; i++) out[i] = (float)p[i];
    }
    const uint8_t *row = p - (bits * i) / 8;  /* the rest (and the other widths) one code at a time */
    for (; i < n; i++) out[i] = (float)code_at(row, bits, i);
}

/* out[lo:hi] of each subspace = its codes (as float) of one token's row. */
static inline void codes_of(const uint8_t *row, const int *meta, int subspaces, float *out) {
    for (int g = 0; g < subspaces; g++)
        unpack_run(row + meta[4 * g + 3], meta[4 * g + 2], meta[4 * g + 1] - meta[4 * g], out + meta[4 * g]);
}

/* A row's codes in a few vector instructions: every code's two bytes gathered into a 16-bit lane by one byte
 * permutation of the row (loaded whole, at most 64 bytes), shifted and masked; 32 codes a block. The plan is made
 * once a call from the layout; longer rows (and builds without FAST_CODES) take `codes_of`. */
struct code_plan {
#ifdef FAST_CODES
    __m512i perm[MAXDIM / 32], shift[MAXDIM / 32], mask[MAXDIM / 32];
    __mmask64 load;
#endif
    int blocks;  /* 0: no plan (codes_of) */
};

static void plan_codes(const int *meta, int subspaces, int row_bytes, struct code_plan *p) {
    p->blocks = 0;
#ifdef FAST_CODES
    if (row_bytes > 64 || subspaces <= 0) return;
    uint8_t perm[MAXDIM / 32][64];
    uint16_t shift[MAXDIM / 32][32], mask[MAXDIM / 32][32];
    memset(perm, 0, sizeof perm), memset(shift, 0, sizeof shift), memset(mask, 0, sizeof mask);
    int n = 0;
    for (int g = 0; g < subspaces; g++) {
        const int lo = meta[4 * g], hi = meta[4 * g + 1], bits = meta[4 * g + 2], byte = meta[4 * g + 3];
        for (int i = lo; i < hi; i++) {
            const int pos = 8 * byte + bits * (i - lo), b = pos >> 3, k = i / 32, lane = i % 32;
            perm[k][2 * lane] = (uint8_t)b, perm[k][2 * lane + 1] = (uint8_t)(b + 1 < 64 ? b + 1 : 63);
            shift[k][lane] = (uint16_t)(pos & 7), mask[k][lane] = (uint16_t)((1u << bits) - 1);
        }
        if (hi > n) n = hi;
    }
    p->blocks = (n + 31) / 32;
    for (int k = 0; k < p->blocks; k++) {
        p->perm[k] = _mm512_loadu_si512(perm[k]);
        p->shift[k] = _mm512_loadu_si512(shift[k]);
        p->mask[k] = _mm512_loadu_si512(mask[k]);
    }
    p->load = row_bytes == 64 ? ~(__mmask64)0 : (((__mmask64)1 << row_bytes) - 1);
#else
    (void)meta, (void)subspaces, (void)row_bytes;
#endif
}

/* out[0:32 * blocks] = the codes of one row (as float; zeros past the last) with a plan, else codes_of. */
static inline void row_codes(const uint8_t *row, const struct code_plan *p, const int *meta, int subspaces,
                             float *out) {
#ifdef FAST_CODES
    if (p->blocks) {
        const __m512i r = _mm512_maskz_loadu_epi8(p->load, row);
        for (int k = 0; k < p->blocks; k++) {
            __m512i v = _mm512_permutexvar_epi8(p->perm[k], r);
            v = _mm512_and_si512(_mm512_srlv_epi16(v, p->shift[k]), p->mask[k]);
            _mm512_storeu_ps(out + 32 * k, _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v))));
            _mm512_storeu_ps(out + 32 * k + 16,
                             _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1))));
        }
        return;
    }
#endif
    codes_of(row, meta, subspaces, out);
}

struct sub_args {
    const float *q;                  /* [bh, rows, dim] */
    const uint8_t *kc, *vc;          /* [bh, tokens, kbytes / vbytes] */
    const int *kmeta, *vmeta;        /* 4 ints a subspace */
    const half *kscale, *kzero;      /* [bh, tokens / kgroup, krank] fp16 (lane factors not needed: codes read exact) */
    const float *w, *mean;           /* [heads, krank, dim], [heads, dim] */
    const float *cos_t, *sin_t;      /* [tokens, dim / 2] or NULL */
    const half *vscale;              /* [bh, tokens, vsub] fp16 (a coefficient is (code - vmid) * scale * vstep) */
    const float *vstep, *vmid;       /* [vsub] */
    const uint8_t *valid;            /* [batch, tokens] or NULL */
    const struct code_plan *kplan, *vplan;
    int heads, tokens, dim, rows, kbytes, vbytes, ksub, vsub, krank, vrank, kgroup, per;
    float scale;
};

/* One task: rows of head bh over tokens [t0, t0 + n); writes mx[rows], sum[rows], acc[rows, vrank]; s: rows x per. */
static void sub_task(const struct sub_args *a, int bh, int t0, int n, float *s, float *mx, float *sum, float *acc,
                     float *wg, const int dim) {
    const int h = bh % a->heads, b = bh / a->heads, pairs = dim / 2, R = a->rows, rank = a->krank;
    const float *q = a->q + (long)bh * R * dim, *w = a->w + (long)h * rank * dim, *mean = a->mean + (long)h * dim;
    const uint8_t *valid = a->valid ? a->valid + (long)b * a->tokens : 0;
    float z[4][MAXDIM], key[4][MAXDIM], mg[MAXDIM], m[MAXROWS];
    for (int r = 0; r < R; r++) m[r] = NEG;
    for (int t = t0; t < t0 + n; t++) {
        float *st = s + (t - t0);
        if (t == t0 || t % a->kgroup == 0) {  /* a key group: its scales into the basis (wg), its zeros into the mean */
            const long g = ((long)bh * (a->tokens / a->kgroup) + t / a->kgroup) * rank;
            const half *ks = a->kscale + g, *kz = a->kzero + g;
            for (int d = 0; d < dim; d++) mg[d] = mean[d];
            for (int j = 0; j < rank; j++) {
                const float *wj = w + (long)j * dim, sj = (float)ks[j], zj = (float)kz[j];
                float *gj = wg + (long)j * dim;
#pragma omp simd
                for (int d = 0; d < dim; d++) gj[d] = sj * wj[d], mg[d] += zj * wj[d];
            }
        }
        /* four tokens of one key group at once where they are there, else one */
        const int four = t % 4 == 0 && t + 4 <= t0 + n && (t + 3) / a->kgroup == t / a->kgroup;
        const int u_n = four ? 4 : 1;
        for (int u = 0; u < u_n; u++)
            row_codes(a->kc + ((long)bh * a->tokens + t + u) * a->kbytes, a->kplan, a->kmeta, a->ksub, z[u]);
        const float *ct = a->cos_t ? a->cos_t + (long)t * pairs : 0, *sn = a->sin_t ? a->sin_t + (long)t * pairs : 0;
#ifdef FAST_KEYS
        if (four && dim % 64 == 0) {
            float dots[4][MAXROWS];
            rebuild_keys4_avx(z, wg, mg, ct, sn, rank, dim, key);
            dots4_avx(q, R, key, dim, dots);
            for (int u = 0; u < 4; u++) {
                const int hidden = valid && !valid[t + u];
                for (int r = 0; r < R; r++) {
                    const float dot = hidden ? NEG : dots[u][r] * a->scale;
                    st[(long)r * a->per + u] = dot;
                    if (dot > m[r]) m[r] = dot;
                }
            }
            t += 3;
            continue;
        }
#endif
        if (four)
            rebuild_keys4(z, wg, mg, ct, sn, rank, dim, key);
        else
            rebuild_key(z[0], wg, mg, ct, sn, rank, dim, key[0]);
        for (int u = 0; u < u_n; u++) {
            const int hidden = valid && !valid[t + u];
            for (int r = 0; r < R; r++) {
                const float *qr = q + (long)r * dim;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < dim; d++) dot += qr[d] * key[u][d];
                dot = hidden ? NEG : dot * a->scale;
                st[(long)r * a->per + u] = dot;
                if (dot > m[r]) m[r] = dot;
            }
        }
        t += u_n - 1;
    }
    for (int r = 0; r < R; r++) {
        float *sr = s + (long)r * a->per, l = 0.f;
        const float base = m[r] <= 0.5f * NEG ? 0.f : m[r];
        for (int t = 0; t < n; t++) {
            const float p = expf(sr[t] - base);
            sr[t] = p;
            l += p;
        }
        mx[r] = m[r];
        sum[r] = l;
        for (int j = 0; j < a->vrank; j++) acc[(long)r * a->vrank + j] = 0.f;
    }
    float c[MAXDIM], vs[MAXDIM];
    for (int t = t0; t < t0 + n; t++) {
        if (valid && !valid[t]) continue;
        row_codes(a->vc + ((long)bh * a->tokens + t) * a->vbytes, a->vplan, a->vmeta, a->vsub, c);
        const half *vh = a->vscale + ((long)bh * a->tokens + t) * a->vsub;
        for (int g = 0; g < a->vsub; g++) vs[g] = (float)vh[g] * a->vstep[g];  /* as torch's scale.float() * step */
        for (int g = 0; g < a->vsub; g++) {
            const int lo = a->vmeta[4 * g], hi = a->vmeta[4 * g + 1];
            const float mid = a->vmid[g];
            for (int i = lo; i < hi; i++) c[i] = (c[i] - mid) * vs[g];
        }
        for (int r = 0; r < R; r++) {
            const float p = s[(long)r * a->per + (t - t0)];
            float *ar = acc + (long)r * a->vrank;
#pragma omp simd
            for (int j = 0; j < a->vrank; j++) ar[j] += p * c[j];
        }
    }
}

/* The arguments `subspace_partial` takes (its callers check it: a build of an earlier source reads other types). */
int subspace_abi(void) { return 2; }

/* The softmax partial of rows q [bh, rows, dim] over every token, in `chunks` chunks of `per` tokens per (b, h):
 * mx (NEG where every key is masked), sum [bh, chunks, rows], acc [bh, chunks, rows, vrank] (the probabilities times
 * the values' whitened coefficients, unnormalized), work [bh, chunks, rows, per]; `per` a multiple of kgroup.
 * The key scales and zeros [bh, tokens / kgroup, krank] and the value scales [bh, tokens, vsub] are the codes' fp16.
 * Returns 0, -1 for a shape it does not take, -2 when out of memory. */
int subspace_partial(const float *q, int bh, int heads, int tokens, int dim, int rows,
                     const uint8_t *kc, int kbytes, const int *kmeta, int ksub, int krank, int kgroup,
                     const half *kscale, const half *kzero, const float *w, const float *mean,
                     const float *cos_t, const float *sin_t, float scale,
                     const uint8_t *vc, int vbytes, const int *vmeta, int vsub, int vrank,
                     const half *vscale, const float *vstep, const float *vmid, const uint8_t *valid,
                     int chunks, int per, float *mx, float *sum, float *acc, float *work, int threads) {
    if (dim % 2 || dim > MAXDIM || krank > MAXDIM || vrank > MAXDIM || rows > MAXROWS || kgroup <= 0 ||
        tokens % kgroup)
        return -1;
    fill_luts();  /* before the threads start (they only read it) */
    /* each thread's copy of a key group's scaled basis */
    float *wbuf = malloc(sizeof(float) * (size_t)threads * (krank > 0 ? krank : 1) * dim);
    if (!wbuf) return -2;
    struct code_plan kplan, vplan;
    plan_codes(kmeta, ksub, kbytes, &kplan), plan_codes(vmeta, vsub, vbytes, &vplan);
    struct sub_args a = {q, kc, vc, kmeta, vmeta, kscale, kzero, w, mean, cos_t, sin_t, vscale, vstep, vmid, valid,
                         &kplan, &vplan, heads, tokens, dim, rows, kbytes, vbytes, ksub, vsub, krank, vrank, kgroup,
                         per, scale};
#pragma omp parallel for collapse(2) schedule(dynamic) num_threads(threads)
    for (int i = 0; i < bh; i++) {
        for (int k = 0; k < chunks; k++) {
            const int t0 = k * per, n = tokens - t0 < per ? tokens - t0 : per;
            const long slot = (long)i * chunks + k;
            float *s = work + slot * rows * per, *mo = mx + slot * rows, *so = sum + slot * rows;
            float *ao = acc + slot * rows * vrank, *wg = wbuf + (long)omp_get_thread_num() * krank * dim;
            if (n <= 0) {
                for (int r = 0; r < rows; r++) mo[r] = NEG, so[r] = 0.f;
                for (int j = 0; j < rows * vrank; j++) ao[j] = 0.f;
            } else if (dim == 64)
                sub_task(&a, i, t0, n, s, mo, so, ao, wg, 64);
            else if (dim == 128)
                sub_task(&a, i, t0, n, s, mo, so, ao, wg, 128);
            else if (dim == 256)
                sub_task(&a, i, t0, n, s, mo, so, ao, wg, 256);
            else
                sub_task(&a, i, t0, n, s, mo, so, ao, wg, dim);
        }
    }
    free(wbuf);
    return 0;
}
