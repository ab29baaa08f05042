/* Decode attention over one quantized segment, computed from its packed codes on the CPU (see native.py).

   For every (batch row b, KV head h) the M query rows of the head's group attend over the segment's T tokens:
   keys are codes per channel in groups of `kgroup` tokens (k = code * ks[g] + kz[g]), values codes per token in
   groups of `vgroup` channels (v = code * vs[t, j] + vz[t, j]); codes of one token are packed along the channel dim,
   `8 / bits` per byte, lowest channel in the lowest bits. The result is a softmax partial per row: its max, its sum
   of exp(score - max) and the unnormalized output, as `blockwise.combine` merges them.

   Nothing is dequantized into memory: the scale of a key group is folded into the query (one scaled query per group
   and row), its zero into one bias per row; a tile of up to 64 tokens is unpacked into a small float buffer that
   stays in L1 and is read by every row of the group. Values: each token's codes times its scales, then one
   multiply-add per row and channel; the zeros add one dot product per row and group.

   Work is split into tasks of (b, h, token chunk), run on OpenMP threads; chunks merge by their log-sum-exp.
   Masked keys (`valid` == 0) score NEG, so exp gives exactly 0 without the infinities that -ffast-math excludes;
   a row that sees no key reports max -inf, sum 0, output 0. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fp16_bits.h"

#define MAXM 16           /* query rows per KV head */
#define MAXD 256          /* head dim */
#define MAXTG 64          /* tokens per tile */
#define MAXW 256          /* widest row rows_update keeps in registers: max(MAXTG, MAXD) */
#define MAXG 32           /* per-token key scales (groups of channels) */
#define NEG (-3.0e38f)    /* a masked score */
#define MAXDENSE 64       /* full-precision tokens attended in the same call as per-token codes */
#define INLINE static inline __attribute__((always_inline))

INLINE uint32_t load32(const uint8_t* p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return w;
}

/* acc[r * W + x] += sum_k w[r * ws + k] c[k * W + x] for r < MB, x < W, k < K: MB (up to 4) rows of weights against
   the K rows of c, each row of c loaded once for all MB rows. MB and W are constants where it is inlined, so the
   MB x W sums stay in registers. */
INLINE void rows_update(const float* w, int64_t ws, const int MB, int K, const float* c, const int W, float* acc) {
    float a[4 * MAXW] __attribute__((aligned(64)));
    memcpy(a, acc, sizeof(float) * MB * W);
    for (int k = 0; k < K; k++) {
        const float* ck = c + (int64_t)k * W;
        for (int r = 0; r < MB; r++) {
            const float wr = w[r * ws + k];
            for (int x = 0; x < W; x++) a[r * W + x] += wr * ck[x];
        }
    }
    memcpy(acc, a, sizeof(float) * MB * W);
}

/* `rows_update` for any number M of rows, four at a time (row r's sums at acc + r * W). */
INLINE void rows_update_all(const float* w, int64_t ws, int M, int K, const float* c, const int W, float* acc) {
    for (int m0 = 0; m0 < M; m0 += 4) {
        const float* wm = w + m0 * ws;
        float* am = acc + m0 * W;
        switch (M - m0 < 4 ? M - m0 : 4) {
            case 4: rows_update(wm, ws, 4, K, c, W, am); break;
            case 3: rows_update(wm, ws, 3, K, c, W, am); break;
            case 2: rows_update(wm, ws, 2, K, c, W, am); break;
            default: rows_update(wm, ws, 1, K, c, W, am); break;
        }
    }
}

/* Scores s[m * n + t0 + tt] (tt < nt) of the rows q[M, D] over a channel-major tile t[d * TG + tt], plus bias[m]
   (NULL: none). */
INLINE void tile_scores(const float* q, int M, const int D, const float* t, const int TG, const float* bias,
                        int nt, int64_t n, int t0, float* s) {
    float out[MAXM * MAXTG] __attribute__((aligned(64)));
    for (int m = 0; m < M; m++)
        for (int tt = 0; tt < TG; tt++) out[m * TG + tt] = bias ? bias[m] : 0.f;
    rows_update_all(q, D, M, D, t, TG, out);
    for (int m = 0; m < M; m++) memcpy(s + (int64_t)m * n + t0, out + m * TG, nt * sizeof(float));
}

/* A KIVI segment's scales and zeros from a chunk's first token on: keys ks, kz [groups, D], values vs, vz [n, J],
   float32, or, where ksh / vsh are set, the codes' fp16 in the same layouts (read as float32 where they are used:
   the same numbers as a float32 copy). */
struct kivi_scales {
    const float *ks, *kz, *vs, *vz;
    const half *ksh, *kzh, *vsh, *vzh;
};

/* Scores s[m * n + t] of rows q[M, D] over tokens [0, n) of codes kc (row stride kc_st bytes), the key group scales
   and zeros of sc. TG (a divisor of kgroup) tokens per tile. */
INLINE void scores(const float* q, int M, const int D, const uint8_t* kc, int64_t kc_st, int kbits, int kgroup,
                   const struct kivi_scales* sc, int n, float* s, const int TG) {
    const int kper = 8 / kbits, words = D / kper / 4, mask = (1 << kbits) - 1;
    float qs[MAXM * MAXD], bias[MAXM];
    float cbt[MAXD * MAXTG] __attribute__((aligned(64)));  /* cbt[d * TG + tt]: code of channel d, token tt */
    uint32_t trw[MAXD / 4 * MAXTG] __attribute__((aligned(64)));  /* trw[w * TG + tt]: code bytes 4w..4w+3 */
    for (int g0 = 0; g0 < n; g0 += kgroup) {
        const int64_t g = g0 / kgroup;
        const int g1 = g0 + kgroup < n ? g0 + kgroup : n;
        float ks[MAXD], kz[MAXD];  /* the group's scales and zeros as float32 */
        if (sc->ksh)
            for (int d = 0; d < D; d++) ks[d] = (float)sc->ksh[g * D + d], kz[d] = (float)sc->kzh[g * D + d];
        else
            memcpy(ks, sc->ks + g * D, sizeof(float) * D), memcpy(kz, sc->kz + g * D, sizeof(float) * D);
        for (int m = 0; m < M; m++) {  /* the row times the group's scales, and times its zeros */
            float b = 0.f;
            for (int d = 0; d < D; d++) {
                b += q[m * D + d] * kz[d];
                qs[m * D + d] = q[m * D + d] * ks[d];
            }
            bias[m] = b;
        }
        for (int t0 = g0; t0 < g1; t0 += TG) {
            const int nt = g1 - t0 < TG ? g1 - t0 : TG;
            for (int tt = 0; tt < nt; tt++) {
                const uint8_t* row = kc + (int64_t)(t0 + tt) * kc_st;
                for (int w = 0; w < words; w++) trw[w * TG + tt] = load32(row + 4 * w);
            }
            for (int w = 0; w < words; w++)  /* byte 4w + k / kper, lane k % kper: channel 4 w kper + k */
                for (int k = 0; k < 4 * kper; k++) {
                    const int sh = 8 * (k / kper) + kbits * (k % kper);
                    float* c = cbt + (4 * w * kper + k) * TG;
                    const uint32_t* src = trw + w * TG;
                    for (int tt = 0; tt < TG; tt++) c[tt] = (float)((src[tt] >> sh) & mask);
                }
            tile_scores(qs, M, D, cbt, TG, bias, nt, n, t0, s);
        }
    }
}

/* exp(s - row max) in place; the row max (NEG when every key is masked) and the row sum out. */
static void softmax_rows(float* s, int M, int n, float* mx_out, float* sum_out) {
    for (int m = 0; m < M; m++) {
        float* sm = s + (int64_t)m * n;
        float mx = NEG;
        for (int t = 0; t < n; t++) mx = sm[t] > mx ? sm[t] : mx;
        const float ms = mx <= 0.5f * NEG ? 0.f : mx;
        float tot = 0.f;
        for (int t = 0; t < n; t++) {
            sm[t] = expf(sm[t] - ms);
            tot += sm[t];
        }
        mx_out[m] = mx;
        sum_out[m] = tot;
    }
}

/* c[l * vpb + j] = code of lane l of byte j, times sj[j] (vpb = D * bits / 8 bytes). */
INLINE void unpack_scaled(const uint8_t* row, const float* sj, float* c, const int D, const int bits) {
    const int per = 8 / bits, vpb = D / per, mask = (1 << bits) - 1;
    for (int l = 0; l < per; l++)
        for (int j = 0; j < vpb; j++) c[l * vpb + j] = (float)((row[j] >> (bits * l)) & mask) * sj[j];
}

/* out[m, d] = sum_t p[m * n + t] v[t, d] from value codes vc (row stride vc_st), scales and zeros vs, vz [n, J]
   float32; or, where vsh is set, fp16 scales vsh and zeros vzh (rows vh_st apart; vzh NULL: each zero is voff times
   its scale), read a tile at a time. Codes unpack lane by lane: lane l of byte j is channel j * vper + l, held at
   i = l * vpb + j. */
INLINE void values(const float* p, int M, const int D, const uint8_t* vc, int64_t vc_st, int vbits, int vgroup,
                   const float* vs, const float* vz, const half* vsh, const half* vzh, int64_t vh_st, float voff,
                   const float* lut, int n, float* out) {
    const int vper = 8 / vbits, vpb = D / vper, J = D / vgroup;
    float acc[MAXM * MAXD] __attribute__((aligned(64)));
    float accz[MAXM * MAXD];
    float cw[MAXTG * MAXD] __attribute__((aligned(64)));  /* cw[tt * D + i]: code times its scale */
    float vst[MAXTG * MAXG], vzt[MAXTG * MAXG];            /* a tile's fp16 scales and zeros as float32 */
    int grp[MAXD];                                          /* the scale group of byte j */
    for (int j = 0; j < vpb; j++) grp[j] = j * vper / vgroup;
    const int bpg = vgroup % vper == 0 ? vgroup / vper : 0;  /* bytes per scale group (0: a byte spans groups) */
    memset(acc, 0, sizeof(float) * M * D);
    memset(accz, 0, sizeof(float) * M * J);
    for (int t0 = 0; t0 < n; t0 += MAXTG) {
        const int nt = n - t0 < MAXTG ? n - t0 : MAXTG;
        if (vsh)
            for (int tt = 0; tt < nt; tt++)
                for (int j = 0; j < J; j++) {
                    const float x = (float)vsh[(int64_t)(t0 + tt) * vh_st + j];
                    vst[tt * J + j] = x;
                    vzt[tt * J + j] = vzh ? (float)vzh[(int64_t)(t0 + tt) * vh_st + j] : voff * x;
                }
        for (int tt = 0; tt < nt; tt++) {
            const uint8_t* row = vc + (int64_t)(t0 + tt) * vc_st;
            const float* sc = vsh ? vst + tt * J : vs + (int64_t)(t0 + tt) * J;
            float sj[MAXD] __attribute__((aligned(64)));
            if (bpg)  /* whole bytes per group: each group's scale broadcast over its bytes */
                for (int g = 0; g < J; g++)
                    for (int j = 0; j < bpg; j++) sj[g * bpg + j] = sc[g];
            else
                for (int j = 0; j < vpb; j++) sj[j] = sc[grp[j]];
            float* c = cw + tt * D;
            if (lut) {  /* 8-bit float codes: their value from the table */
                for (int j = 0; j < vpb; j++) c[j] = lut[row[j]] * sj[j];
                continue;
            }
            switch (vbits) {  /* the width as a constant, so that the loops unroll into whole vectors */
                case 2: unpack_scaled(row, sj, c, D, 2); break;
                case 4: unpack_scaled(row, sj, c, D, 4); break;
                default: unpack_scaled(row, sj, c, D, 8); break;
            }
        }
        rows_update_all(p + t0, n, M, nt, cw, D, acc);  /* each row of cw read once per four rows */
        for (int m = 0; m < M; m++) {
            const float* pm = p + (int64_t)m * n + t0;
            const float* z = vsh ? vzt : vz + (int64_t)t0 * J;
            for (int j = 0; j < J; j++) {
                float zj = 0.f;
                for (int tt = 0; tt < nt; tt++) zj += pm[tt] * z[tt * J + j];
                accz[m * J + j] += zj;
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int l = 0; l < vper; l++)
            for (int j = 0; j < vpb; j++) {
                const int d = j * vper + l;
                out[m * D + d] = acc[m * D + l * vpb + j] + accz[m * J + d / vgroup];
            }
}

/* Scores s[M, n] -> the chunk's partial: masked keys (valid[t] == 0) score NEG, softmax per row, then the values. */
INLINE void scores_to_partial(float* s, int M, const int D, int n, const uint8_t* valid, const uint8_t* vc,
                              int64_t vc_st, int vbits, int vgroup, const float* vs, const float* vz, const half* vsh,
                              const half* vzh, int64_t vh_st, float voff, const float* lut, float* mx, float* sum,
                              float* acc) {
    if (valid)
        for (int t = 0; t < n; t++)
            if (!valid[t])
                for (int m = 0; m < M; m++) s[(int64_t)m * n + t] = NEG;
    softmax_rows(s, M, n, mx, sum);
    values(s, M, D, vc, vc_st, vbits, vgroup, vs, vz, vsh, vzh, vh_st, voff, lut, n, acc);
}

/* One task: the partial of rows q[M, D] over n tokens (pointers already at the chunk's first token). */
INLINE void chunk_partial(const float* q, int M, const int D, int n, const uint8_t* kc, int64_t kc_st, int kbits,
                          int kgroup, const struct kivi_scales* sc, const uint8_t* vc, int64_t vc_st,
                          int vbits, int vgroup, const uint8_t* valid,
                          float* s, float* mx, float* sum, float* acc, const int TG) {
    scores(q, M, D, kc, kc_st, kbits, kgroup, sc, n, s, TG);
    scores_to_partial(s, M, D, n, valid, vc, vc_st, vbits, vgroup, sc->vs, sc->vz, sc->vsh, sc->vzh, D / vgroup, 0.f,
                      0, mx, sum, acc);
}

#define VARIANT(DD, TT)                                                                                          \
    if (D == DD && TG == TT) {                                                                                   \
        chunk_partial(q, M, DD, n, kc, kc_st, kbits, kgroup, sc, vc, vc_st, vbits, vgroup, valid, s,         \
                      mx, sum, acc, TT);                                                                         \
        return;                                                                                                  \
    }
#define TILES(DD) VARIANT(DD, 64) VARIANT(DD, 32) VARIANT(DD, 16)

static void dispatch(const float* q, int M, int D, int n, const uint8_t* kc, int64_t kc_st, int kbits, int kgroup,
                     const struct kivi_scales* sc, const uint8_t* vc, int64_t vc_st, int vbits, int vgroup,
                     const uint8_t* valid, float* s, float* mx, float* sum, float* acc, int TG) {
    TILES(64) TILES(128) TILES(256)
}

static int tile_for(int kgroup) { return kgroup % 64 == 0 ? 64 : kgroup % 32 == 0 ? 32 : kgroup % 16 == 0 ? 16 : 0; }

/* 1 when this file has a variant for the shape (the caller falls back to its torch path otherwise). */
int native_supports(int M, int D, int kbits, int vbits, int kgroup, int vgroup) {
    int bits_ok = (kbits == 2 || kbits == 4 || kbits == 8) && (vbits == 2 || vbits == 4 || vbits == 8);
    return M >= 1 && M <= MAXM && (D == 64 || D == 128 || D == 256) && bits_ok && tile_for(kgroup) > 0 &&
           vgroup > 0 && D % vgroup == 0;
}

/* Merge the chunk partials of every row (rows = B H, M each) by their log-sum-exp into mx_out, sum_out [rows, M]
   and acc_out [rows, M, D]; a row that saw no key in any chunk reports max -inf, sum 0, output 0. */
static void merge_chunks(int64_t rows, int M, int D, int chunks, const float* cmx, const float* csum,
                         const float* cacc, float* mx_out, float* sum_out, float* acc_out) {
    for (int64_t r = 0; r < rows * M; r++) {  /* merge the chunks of each row */
        const int64_t bh = r / M, m = r % M;
        float mx = NEG;
        for (int c = 0; c < chunks; c++) mx = cmx[(bh * chunks + c) * M + m] > mx ? cmx[(bh * chunks + c) * M + m] : mx;
        float* out = acc_out + r * D;
        memset(out, 0, sizeof(float) * D);
        if (mx <= 0.5f * NEG) {  /* no key in any chunk */
            const uint32_t minus_inf = 0xff800000u;
            memcpy(&mx_out[r], &minus_inf, sizeof(float));
            sum_out[r] = 0.f;
            continue;
        }
        float tot = 0.f;
        for (int c = 0; c < chunks; c++) {
            const int64_t i = (bh * chunks + c) * M + m;
            const float w = expf(cmx[i] - mx);
            tot += csum[i] * w;
            for (int d = 0; d < D; d++) out[d] += cacc[i * D + d] * w;
        }
        mx_out[r] = mx;
        sum_out[r] = tot;
    }
}

/* Every task (row b, head h, token chunk c of `per` tokens) on OpenMP threads: `fn` writes the chunk's partial into
   its slots of cmx, csum [rows, slots, M] and cacc [rows, slots, M, D] (slots >= chunks), its scores into work (M
   floats per token); a chunk past the last token gets the empty partial. */
typedef void (*task_fn)(const void* args, int64_t b, int64_t h, int64_t bh, int t0, int n, float* s, float* mx,
                        float* sum, float* acc);

static void run_tasks(int64_t rows, int H, int M, int D, int T, int per, int chunks, int slots, int threads,
                      task_fn fn, const void* args, float* work, float* cmx, float* csum, float* cacc) {
    const int64_t tasks = rows * chunks;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t bh = task / chunks, b = bh / H, h = bh % H;
        const int c = task % chunks, t0 = c * per, n = T - t0 < per ? T - t0 : per;
        float* mx = cmx + (bh * slots + c) * M;
        float* sum = csum + (bh * slots + c) * M;
        float* acc = cacc + (bh * slots + c) * M * D;
        if (n <= 0) {
            for (int m = 0; m < M; m++) mx[m] = NEG, sum[m] = 0.f;
            memset(acc, 0, sizeof(float) * M * D);
            continue;
        }
        fn(args, b, h, bh, t0, n, work + (bh * T + t0) * M, mx, sum, acc);
    }
}

/* The softmax partial over one segment for every (b, h): mx_out, sum_out [B, H, M], acc_out [B, H, M, D].
   q [B, H, M, D] float32 contiguous; kc, vc uint8 with element strides (b, h, token) and contiguous bytes;
   ks, kz [B, H, T / kgroup, D] and vs, vz [B, H, T, D / vgroup] float32 contiguous (or, where ksh / vsh are set,
   ksh, kzh, vsh, vzh: the same in fp16); valid [B, T] uint8 or NULL.
   The token range splits into `chunks` chunks (whole key groups); work holds B H M T floats, cmx and csum
   B H chunks M, cacc B H chunks M D. Returns 1 (and computes nothing) for an unsupported shape. */
struct quant_args {
    const float* q; int M, D, T, G, J, TG;
    const uint8_t* kc; int64_t kc_sb, kc_sh, kc_st; int kbits, kgroup; const float *ks, *kz;
    const uint8_t* vc; int64_t vc_sb, vc_sh, vc_st; int vbits, vgroup; const float *vs, *vz;
    const uint8_t* valid;
    const half *ksh, *kzh, *vsh, *vzh;
};

static void quant_task(const void* p, int64_t b, int64_t h, int64_t bh, int t0, int n, float* s, float* mx,
                       float* sum, float* acc) {
    const struct quant_args* a = p;
    const int M = a->M, D = a->D, T = a->T, G = a->G, J = a->J, kgroup = a->kgroup;
    const int64_t ko = (bh * G + t0 / kgroup) * D, vo = (bh * T + t0) * J;
    const struct kivi_scales sc = {a->ks ? a->ks + ko : 0, a->kz ? a->kz + ko : 0, a->vs ? a->vs + vo : 0,
                                   a->vz ? a->vz + vo : 0, a->ksh ? a->ksh + ko : 0, a->kzh ? a->kzh + ko : 0,
                                   a->vsh ? a->vsh + vo : 0, a->vzh ? a->vzh + vo : 0};
    dispatch(a->q + bh * M * D, M, D, n, a->kc + b * a->kc_sb + h * a->kc_sh + t0 * a->kc_st, a->kc_st, a->kbits,
             kgroup, &sc, a->vc + b * a->vc_sb + h * a->vc_sh + t0 * a->vc_st, a->vc_st, a->vbits, a->vgroup,
             a->valid ? a->valid + b * T + t0 : 0, s, mx, sum, acc, a->TG);
}

int quant_partial(const float* q, int B, int H, int M, int D, int T,
                  const uint8_t* kc, int64_t kc_sb, int64_t kc_sh, int64_t kc_st, int kbits, int kgroup,
                  const float* ks, const float* kz,
                  const uint8_t* vc, int64_t vc_sb, int64_t vc_sh, int64_t vc_st, int vbits, int vgroup,
                  const float* vs, const float* vz, const uint8_t* valid, int chunks, int threads,
                  float* work, float* cmx, float* csum, float* cacc, float* mx_out, float* sum_out, float* acc_out) {
    if (!native_supports(M, D, kbits, vbits, kgroup, vgroup) || T % kgroup || chunks < 1) return 1;
    const int G = T / kgroup;
    const struct quant_args a = {q, M, D, T, G, D / vgroup, tile_for(kgroup), kc, kc_sb, kc_sh, kc_st, kbits, kgroup,
                                 ks, kz, vc, vc_sb, vc_sh, vc_st, vbits, vgroup, vs, vz, valid, 0, 0, 0, 0};
    run_tasks(B * H, H, M, D, T, (G + chunks - 1) / chunks * kgroup, chunks, chunks, threads, quant_task, &a, work,
              cmx, csum, cacc);
    merge_chunks(B * H, M, D, chunks, cmx, csum, cacc, mx_out, sum_out, acc_out);
    return 0;
}

/* The partial of rows q[M, D] over nd full-precision tokens dk, dv [nd, D] (float32): the new tokens of a decode step
   (or a tiered layer's tail), attended beside the codes in the same call; valid [nd] (0: a token the rows do not
   see) or NULL; s holds nd floats of scores. A row that sees no token gets max NEG, sum 0, output 0. */
static void dense_partial(const float* q, int M, int D, int nd, const float* dk, const float* dv,
                          const uint8_t* valid, float* s, float* mx, float* sum, float* acc) {
    for (int m = 0; m < M; m++) {
        float best = NEG;
        for (int t = 0; t < nd; t++) {
            float x = 0.f;
            for (int d = 0; d < D; d++) x += q[m * D + d] * dk[t * D + d];
            s[t] = valid && !valid[t] ? NEG : x;
            best = s[t] > best ? s[t] : best;
        }
        const float shift = best <= 0.5f * NEG ? 0.f : best;  /* every token masked: all exp give 0 */
        float tot = 0.f, *out = acc + m * D;
        memset(out, 0, sizeof(float) * D);
        for (int t = 0; t < nd; t++) {
            const float p = expf(s[t] - shift);
            tot += p;
            for (int d = 0; d < D; d++) out[d] += p * dv[t * D + d];
        }
        mx[m] = best;
        sum[m] = tot;
    }
}

/* ---- per-token key codes (the uniform cache's format) ------------------------------------------------------------

   Keys are codes per token in groups of `kgroup` channels (k = code * ks[t, g] + kz[t, g]; a symmetric format passes
   kz = -offset * ks), packed as the values are; 8-bit float codes (fp8) pass a table of their 256 values (klut,
   vlut), read in place of the code. With a pre-RoPE frame (cshift != NULL) the codes hold normalized
   pre-RoPE keys: the key is then R(t) (k * cscale + cshift), R(t) the rotation of rotate_half RoPE by the angles
   whose cos / sin are rc[j, t], rs[j, t] (j < D / 2). Each tile of tokens is decoded into a small float buffer once
   and read by every query row of the KV head. */

/* Scores s[m * n + t] of rows q[M, D] over tokens [0, n) of per-token key codes kc (row stride kc_st bytes), fp16
   scales and zeros ks, kz [n, D / kgroup] (rows kh_st apart; kz NULL: each zero is koff times its scale); with a
   pre-RoPE frame, cos / sin rows rc, rs [D / 2, r_st] (token t at column t).
   A tile of MAXTG tokens is decoded channel-major (kt[d * MAXTG + tt]), so that every step runs along the tokens. */
INLINE void token_scores(const float* q, int M, const int D, int n, const uint8_t* kc, int64_t kc_st,
                         const int kbits, int kgroup, const half* ks, const half* kz, int64_t kh_st, float koff,
                         const float* klut,
                         const float* cshift, const float* cscale, const float* rc, const float* rs, int64_t r_st,
                         const float* rc0, const float* rs0, float* s) {
    enum { TG = MAXTG };
    const int per = 8 / kbits, words = D / per / 4, mask = (1 << kbits) - 1, G = D / kgroup, half = D / 2;
    uint32_t trw[MAXD / 4 * TG] __attribute__((aligned(64)));  /* trw[w * TG + tt]: code bytes 4w..4w+3 */
    float sct[MAXG * TG] __attribute__((aligned(64))), zct[MAXG * TG] __attribute__((aligned(64)));
    float kt[MAXD * TG] __attribute__((aligned(64)));
    float qt[MAXM * MAXD] __attribute__((aligned(64)));  /* composed angles: the rows turned back by the tile's first */
    for (int t0 = 0; t0 < n; t0 += TG) {
        const int nt = n - t0 < TG ? n - t0 : TG;
        const float* qr = q;  /* the rows the tile's keys are scored with */
        if (cshift && rc0) {  /* R(p + tt) = R(p) R(tt): keys turned by R(tt) (rc0, rs0), rows by R(p)^T (column t0) */
            for (int j = 0; j < half; j++) {
                const float c = rc[j * r_st + t0], sn = rs[j * r_st + t0];
                for (int m = 0; m < M; m++) {
                    const float a = q[m * D + j], b = q[m * D + j + half];
                    qt[m * D + j] = c * a + sn * b;
                    qt[m * D + j + half] = c * b - sn * a;
                }
            }
            qr = qt;
        }
        for (int tt = 0; tt < TG; tt++) {  /* past the last token: zero codes and scales (scores never read) */
            const int64_t t = t0 + tt;
            const uint8_t* row = kc + t * kc_st;
            for (int w = 0; w < words; w++) trw[w * TG + tt] = tt < nt ? load32(row + 4 * w) : 0u;
            for (int g = 0; g < G; g++) {
                const float x = tt < nt ? (float)ks[t * kh_st + g] : 0.f;
                sct[g * TG + tt] = x;
                zct[g * TG + tt] = tt < nt ? (kz ? (float)kz[t * kh_st + g] : koff * x) : 0.f;
            }
        }
        if (cshift && nt == TG) {  /* a whole tile of pre-RoPE codes: decode channels d and d + D / 2 together and
                                      rotate them while they are in registers (word w + words / 2 holds d + D / 2) */
            for (int w = 0; w < words / 2; w++)
                for (int k = 0; k < 4 * per; k++) {
                    const int d = 4 * w * per + k, e = d + half, sh = 8 * (k / per) + kbits * (k % per);
                    const uint32_t *s1 = trw + w * TG, *s2 = trw + (w + words / 2) * TG;
                    const float *sc1 = sct + (d / kgroup) * TG, *zr1 = zct + (d / kgroup) * TG;
                    const float *sc2 = sct + (e / kgroup) * TG, *zr2 = zct + (e / kgroup) * TG;
                    const float a1 = cscale[d], b1 = cshift[d], a2 = cscale[e], b2 = cshift[e];
                    const float* cr = rc0 ? rc0 + d * TG : rc + d * r_st + t0;
                    const float* sr = rs0 ? rs0 + d * TG : rs + d * r_st + t0;
                    float *c1 = kt + d * TG, *c2 = kt + e * TG;
                    float v1[TG] __attribute__((aligned(64))), v2[TG] __attribute__((aligned(64)));
                    if (klut)
                        for (int tt = 0; tt < TG; tt++) {
                            v1[tt] = klut[(s1[tt] >> sh) & 0xFF];
                            v2[tt] = klut[(s2[tt] >> sh) & 0xFF];
                        }
                    else
                        for (int tt = 0; tt < TG; tt++) {
                            v1[tt] = (float)((s1[tt] >> sh) & mask);
                            v2[tt] = (float)((s2[tt] >> sh) & mask);
                        }
                    for (int tt = 0; tt < TG; tt++) {
                        const float x = v1[tt] * (sc1[tt] * a1) + (zr1[tt] * a1 + b1);
                        const float y = v2[tt] * (sc2[tt] * a2) + (zr2[tt] * a2 + b2);
                        c1[tt] = x * cr[tt] - y * sr[tt];
                        c2[tt] = y * cr[tt] + x * sr[tt];
                    }
                }
            tile_scores(qr, M, D, kt, TG, 0, nt, n, t0, s);
            continue;
        }
        for (int w = 0; w < words; w++)  /* byte 4w + k / per, lane k % per: channel 4 w per + k */
            for (int k = 0; k < 4 * per; k++) {
                const int d = 4 * w * per + k, sh = 8 * (k / per) + kbits * (k % per), g = d / kgroup;
                const uint32_t* src = trw + w * TG;
                const float* sc = sct + g * TG;
                const float* zr = zct + g * TG;
                float* c = kt + d * TG;
                /* (code * s + z) * a + b: a pre-RoPE frame's channel scale and shift folded in (a = 1, b = 0 without) */
                const float a = cshift ? cscale[d] : 1.f, b = cshift ? cshift[d] : 0.f;
                if (klut)  /* 8-bit float codes: the table's value for the code */
                    for (int tt = 0; tt < TG; tt++) c[tt] = klut[(src[tt] >> sh) & 0xFF] * (sc[tt] * a) + (zr[tt] * a + b);
                else
                    for (int tt = 0; tt < TG; tt++) c[tt] = (float)((src[tt] >> sh) & mask) * (sc[tt] * a) + (zr[tt] * a + b);
            }
        if (cshift) {
            for (int j = 0; j < half; j++) {
                float* c1 = kt + j * TG;
                float* c2 = kt + (j + half) * TG;
                const float* cr = rc0 ? rc0 + j * TG : rc + j * r_st + t0;
                const float* sr = rs0 ? rs0 + j * TG : rs + j * r_st + t0;
                for (int tt = 0; tt < nt; tt++) {
                    const float x = c1[tt], y = c2[tt];
                    c1[tt] = x * cr[tt] - y * sr[tt];
                    c2[tt] = y * cr[tt] + x * sr[tt];
                }
            }
        }
        tile_scores(qr, M, D, kt, TG, 0, nt, n, t0, s);
    }
}

/* One task of `token_partial`: rows q[M, D] over n tokens (pointers at the chunk's first token). */
INLINE void token_chunk(const float* q, int M, const int D, int n, const uint8_t* kc, int64_t kc_st, const int kbits,
                        int kgroup, const half* ks, const half* kz, int64_t kh_st, float koff, const uint8_t* vc,
                        int64_t vc_st, int vbits, int vgroup, const half* vs, const half* vz, int64_t vh_st,
                        float voff, const float* klut, const float* vlut,
                        const float* cshift, const float* cscale, const float* rc, const float* rs, int64_t r_st,
                        const float* rc0, const float* rs0, const uint8_t* valid, float* s, float* mx, float* sum,
                        float* acc) {
    token_scores(q, M, D, n, kc, kc_st, kbits, kgroup, ks, kz, kh_st, koff, klut, cshift, cscale, rc, rs, r_st, rc0,
                 rs0, s);
    scores_to_partial(s, M, D, n, valid, vc, vc_st, vbits, vgroup, 0, 0, vs, vz, vh_st, voff, vlut, mx, sum, acc);
}

#define TOKEN_VARIANT(DD, KB)                                                                                    \
    if (D == DD && kbits == KB) {                                                                                \
        token_chunk(q, M, DD, n, kc, kc_st, KB, kgroup, ks, kz, kh_st, koff, vc, vc_st, vbits, vgroup, vs, vz,    \
                    vh_st, voff, klut, vlut,                                                                     \
                    cshift, cscale, rc, rs, r_st, rc0, rs0, valid, s, mx, sum, acc);                             \
        return;                                                                                                  \
    }
#define TOKEN_BITS(DD) TOKEN_VARIANT(DD, 2) TOKEN_VARIANT(DD, 4) TOKEN_VARIANT(DD, 8)

static void token_dispatch(const float* q, int M, int D, int n, const uint8_t* kc, int64_t kc_st, int kbits,
                           int kgroup, const half* ks, const half* kz, int64_t kh_st, float koff, const uint8_t* vc,
                           int64_t vc_st, int vbits, int vgroup, const half* vs, const half* vz, int64_t vh_st,
                           float voff, const float* klut, const float* vlut,
                           const float* cshift, const float* cscale,
                           const float* rc, const float* rs, int64_t r_st, const float* rc0, const float* rs0,
                           const uint8_t* valid, float* s, float* mx, float* sum, float* acc) {
    TOKEN_BITS(64) TOKEN_BITS(128) TOKEN_BITS(256)
}

/* Tokens per tile of `token_partial` (MAXTG): the columns of its rc0, rs0. */
int token_tile(void) { return MAXTG; }

/* How many full-precision tokens `token_partial` attends beside the codes (MAXDENSE). */
int token_max_dense(void) { return MAXDENSE; }

/* 1 when `token_partial` has a variant for the shape. */
int token_supports(int M, int D, int kbits, int vbits, int kgroup, int vgroup) {
    int bits_ok = (kbits == 2 || kbits == 4 || kbits == 8) && (vbits == 2 || vbits == 4 || vbits == 8);
    return M >= 1 && M <= MAXM && (D == 64 || D == 128 || D == 256) && bits_ok && kgroup > 0 && D % kgroup == 0 &&
           D / kgroup <= MAXG && vgroup > 0 && D % vgroup == 0 && vgroup % (8 / vbits) == 0;
}

/* acc[r, :] /= max(sum[r], 1e-30) for `rows` rows of D, as IEEE divisions (no fast-math reciprocal here): the same
   bits as torch's `acc / sum.clamp_min(1e-30)`, a NaN sum staying NaN. */
#if defined(__clang__)
#pragma float_control(precise, on, push)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
#endif
static void normalize_rows(int64_t rows, int D, const float* sum, float* acc) {
    for (int64_t r = 0; r < rows; r++) {
        const float l = sum[r] < 1e-30f ? 1e-30f : sum[r];
        for (int d = 0; d < D; d++) acc[r * D + d] /= l;
    }
}
#if defined(__clang__)
#pragma float_control(pop)
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

/* The softmax partial over one segment of per-token key codes, as `quant_partial` (same outputs, chunks, work):
   fp16 scales and zeros ks, kz [B, H, T, D / kgroup] and vs, vz [B, H, T, D / vgroup], each pair with the element
   strides ks_s / vs_s (b, h, token; the last dim contiguous); kz or vz NULL: each zero is koff / voff times its
   scale (a symmetric format's -offset, fp8's 0). kc, vc uint8 with element strides (b, h, token). Pre-RoPE frame or NULL: cshift, cscale [B or 1, H, D] (batch stride cs_sb: H D or 0) and
   rc, rs [B or 1, D / 2, >= T] (token t of a row at column t; batch stride r_sb, row stride r_st >= T: a view of a
   wider table of positions). rc0, rs0 [D / 2, MAXTG] or NULL: where a row's positions count up by one, the cos / sin
   (no attention scaling) of positions 0..MAXTG-1; a tile's keys are then turned by these and its rows by the
   tile's first column of rc, rs (R(p + t) = R(p) R(t): the wide table is read once a tile). klut, vlut: [256] values of 8-bit float codes, or NULL
   for integer codes. dk, dv [B, H, nd, D] float32 contiguous: nd <= MAXDENSE full-precision tokens after the codes,
   seen by every row (a decode step's new tokens; nd = 0: none), one more partial per row (cmx, csum and cacc hold
   chunks + 1 slots per row then). normalize: acc_out holds the normalized output acc / max(sum, 1e-30) instead
   (a decode step's answer; 0 for a row with no key). Returns 1 for an unsupported shape. */
struct token_args {
    const float* q; int M, D, T;
    const uint8_t* kc; int64_t kc_sb, kc_sh, kc_st; int kbits, kgroup; const half *ks, *kz; int64_t ks_sb, ks_sh, ks_st;
    float koff;
    const uint8_t* vc; int64_t vc_sb, vc_sh, vc_st; int vbits, vgroup; const half *vs, *vz; int64_t vs_sb, vs_sh, vs_st;
    float voff;
    const float *cshift, *cscale; int64_t cs_sb; const float *rc, *rs; int64_t r_sb, r_st; const float *rc0, *rs0;
    const uint8_t* valid;
    const float *klut, *vlut;
};

static void token_task(const void* p, int64_t b, int64_t h, int64_t bh, int t0, int n, float* s, float* mx,
                       float* sum, float* acc) {
    const struct token_args* a = p;
    const int M = a->M, D = a->D, T = a->T;
    const int framed = a->cshift != 0;
    const int64_t ko = b * a->ks_sb + h * a->ks_sh + t0 * a->ks_st, vo = b * a->vs_sb + h * a->vs_sh + t0 * a->vs_st;
    token_dispatch(a->q + bh * M * D, M, D, n, a->kc + b * a->kc_sb + h * a->kc_sh + t0 * a->kc_st, a->kc_st,
                   a->kbits, a->kgroup, a->ks + ko, a->kz ? a->kz + ko : 0, a->ks_st, a->koff,
                   a->vc + b * a->vc_sb + h * a->vc_sh + t0 * a->vc_st, a->vc_st, a->vbits, a->vgroup,
                   a->vs + vo, a->vz ? a->vz + vo : 0, a->vs_st, a->voff, a->klut, a->vlut,
                   framed ? a->cshift + b * a->cs_sb + h * D : 0, framed ? a->cscale + b * a->cs_sb + h * D : 0,
                   framed ? a->rc + b * a->r_sb + t0 : 0, framed ? a->rs + b * a->r_sb + t0 : 0, a->r_st,
                   framed ? a->rc0 : 0, framed ? a->rs0 : 0, a->valid ? a->valid + b * T + t0 : 0, s, mx, sum, acc);
}

int token_partial(const float* q, int B, int H, int M, int D, int T,
                  const uint8_t* kc, int64_t kc_sb, int64_t kc_sh, int64_t kc_st, int kbits, int kgroup,
                  const half* ks, const half* kz, int64_t ks_sb, int64_t ks_sh, int64_t ks_st, float koff,
                  const uint8_t* vc, int64_t vc_sb, int64_t vc_sh, int64_t vc_st, int vbits, int vgroup,
                  const half* vs, const half* vz, int64_t vs_sb, int64_t vs_sh, int64_t vs_st, float voff,
                  const float* cshift, const float* cscale, int64_t cs_sb, const float* rc, const float* rs,
                  int64_t r_sb, int64_t r_st, const float* rc0, const float* rs0, const uint8_t* valid,
                  const float* klut, const float* vlut, const float* dk, const float* dv, int nd, int chunks, int threads, int normalize,
                  float* work, float* cmx, float* csum, float* cacc, float* mx_out, float* sum_out, float* acc_out) {
    if (!token_supports(M, D, kbits, vbits, kgroup, vgroup) || chunks < 1 || nd < 0 || nd > MAXDENSE) return 1;
    if ((klut && kbits != 8) || (vlut && vbits != 8)) return 1;
    const struct token_args a = {q, M, D, T, kc, kc_sb, kc_sh, kc_st, kbits, kgroup, ks, kz, ks_sb, ks_sh, ks_st,
                                 koff, vc, vc_sb, vc_sh, vc_st, vbits, vgroup, vs, vz, vs_sb, vs_sh, vs_st, voff,
                                 cshift, cscale, cs_sb, rc, rs, r_sb, r_st, rc0, rs0, valid, klut, vlut};
    const int per = ((T + chunks - 1) / chunks + 15) / 16 * 16;  /* tokens per chunk */
    const int slots = chunks + (nd > 0);  /* the full-precision tokens: one more partial per row */
    run_tasks(B * H, H, M, D, T, per, chunks, slots, threads, token_task, &a, work, cmx, csum, cacc);
    float s[MAXDENSE];
    for (int64_t bh = 0; nd > 0 && bh < (int64_t)B * H; bh++)
        dense_partial(q + bh * M * D, M, D, nd, dk + bh * nd * D, dv + bh * nd * D, 0, s,
                      cmx + (bh * slots + chunks) * M, csum + (bh * slots + chunks) * M,
                      cacc + (bh * slots + chunks) * M * D);
    merge_chunks(B * H, M, D, slots, cmx, csum, cacc, mx_out, sum_out, acc_out);
    if (normalize) normalize_rows((int64_t)B * H * M, D, sum_out, acc_out);
    return 0;
}

/* ---- a decode step over several KIVI-layout segments and full-precision tokens in one call (the tiered layer) ----

   Segments in key order, each read with its own queries (the step's queries times the segment's key rotation) and
   its output brought back by its value rotation (out times R^T, R [D, D] row-major, per KV head or shared); then nd
   full-precision tokens (the tail, overlays, the new token; dvalid [B, nd] uint8 marks those a row sees, NULL: all). out [B, H, M, D]: the normalized
   attention output (0 for a row that sees no key). work holds B H M max(T, nd) floats, cmx and csum
   B H (nseg chunks + 1) M, cacc B H (nseg chunks + 1) M D. xmx, xsum [B, H, M] and xacc [B, H, M, D] (or NULL): a
   partial over other keys (max NEG where it has none) merged in before the normalization; with it nseg may be 0.
   Returns 1 (computing nothing) for an unsupported shape. */
struct step_segment {
    const float* q;  /* [B, H, M, D] float32: the scaled queries in the segment's key basis */
    int T, kbits, kgroup, vbits, vgroup;
    const uint8_t* kc; int64_t kc_sb, kc_sh, kc_st; const float *ks, *kz;
    const uint8_t* vc; int64_t vc_sb, vc_sh, vc_st; const float *vs, *vz;
    const uint8_t* valid;  /* [B, T] or NULL */
    const float* vrot;     /* [H or 1, D, D] or NULL */
    int64_t vrot_sh;       /* head stride of vrot: D D, or 0 when shared */
    const half *ksh, *kzh, *vsh, *vzh;  /* the scales and zeros in fp16 (then ks .. vz NULL), or NULL */
};

/* Merge `n` partials (slot stride `stride`, from slot 0) of one row of M queries into slot 0 (max, sum, output). */
static void merge_slots(int M, int D, int n, int stride, float* mx, float* sum, float* acc) {
    for (int m = 0; m < M; m++) {
        float best = NEG;
        for (int c = 0; c < n; c++) best = mx[c * stride * M + m] > best ? mx[c * stride * M + m] : best;
        float tot = 0.f, out[MAXD];
        memset(out, 0, sizeof(float) * D);
        if (best > 0.5f * NEG)
            for (int c = 0; c < n; c++) {
                const int64_t i = (int64_t)c * stride * M + m;
                const float w = expf(mx[i] - best);
                tot += sum[i] * w;
                for (int d = 0; d < D; d++) out[d] += acc[i * D + d] * w;
            }
        mx[m] = best;
        sum[m] = tot;
        memcpy(acc + (int64_t)m * D, out, sizeof(float) * D);
    }
}

int segments_step(const struct step_segment* segs, int nseg, int B, int H, int M, int D, const float* q,
                  const float* dk, const float* dv, int nd, const uint8_t* dvalid, int chunks, int threads, float* work, float* cmx,
                  float* csum, float* cacc, const float* xmx, const float* xsum, const float* xacc, float* out) {
    if (nseg < (xmx ? 0 : 1) || chunks < 1 || nd < 0) return 1;
    for (int s = 0; s < nseg; s++)
        if (!native_supports(M, D, segs[s].kbits, segs[s].vbits, segs[s].kgroup, segs[s].vgroup) ||
            segs[s].T % segs[s].kgroup)
            return 1;
    const int slots = nseg * chunks + 1;
    for (int s = 0; s < nseg; s++) {
        const struct step_segment* g = segs + s;
        const int G = g->T / g->kgroup;
        const struct quant_args a = {g->q, M, D, g->T, G, D / g->vgroup, tile_for(g->kgroup), g->kc, g->kc_sb,
                                     g->kc_sh, g->kc_st, g->kbits, g->kgroup, g->ks, g->kz, g->vc, g->vc_sb,
                                     g->vc_sh, g->vc_st, g->vbits, g->vgroup, g->vs, g->vz, g->valid, g->ksh,
                                     g->kzh, g->vsh, g->vzh};
        run_tasks((int64_t)B * H, H, M, D, g->T, (G + chunks - 1) / chunks * g->kgroup, chunks, slots, threads,
                  quant_task, &a, work, cmx + (int64_t)s * chunks * M, csum + (int64_t)s * chunks * M,
                  cacc + (int64_t)s * chunks * M * D);
    }
    const int64_t rows = (int64_t)B * H;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t bh = 0; bh < rows; bh++) {
        float* mx = cmx + bh * slots * M;
        float* sum = csum + bh * slots * M;
        float* acc = cacc + bh * slots * M * D;
        for (int s = 0; s < nseg; s++) {  /* each segment's chunks into its first slot, in the model's basis */
            const int64_t o = (int64_t)s * chunks;
            merge_slots(M, D, chunks, 1, mx + o * M, sum + o * M, acc + o * M * D);
            const float* r = segs[s].vrot;
            if (!r) continue;
            r += (bh % H) * segs[s].vrot_sh;
            for (int m = 0; m < M; m++) {
                float* x = acc + (o * M + m) * D;
                float y[MAXD];
                for (int d = 0; d < D; d++) {
                    float t = 0.f;
                    for (int e = 0; e < D; e++) t += x[e] * r[(int64_t)d * D + e];
                    y[d] = t;
                }
                memcpy(x, y, sizeof(float) * D);
            }
        }
        const int64_t o = (int64_t)nseg * chunks;  /* the full-precision tokens: the last slot */
        if (nd > 0) {
            dense_partial(q + bh * M * D, M, D, nd, dk + bh * nd * D, dv + bh * nd * D,
                          dvalid ? dvalid + (bh / H) * nd : 0, work + bh * nd, mx + o * M, sum + o * M,
                          acc + o * M * D);
        } else {
            for (int m = 0; m < M; m++) mx[o * M + m] = NEG, sum[o * M + m] = 0.f;
            memset(acc + o * M * D, 0, sizeof(float) * M * D);
        }
        merge_slots(M, D, nseg + 1, chunks, mx, sum, acc);  /* slots 0, chunks, 2 chunks, ..., nseg chunks */
        if (xmx)  /* a partial computed before the call (a subspace archive's), in the model's basis */
            for (int m = 0; m < M; m++) {
                const int64_t i = bh * M + m;
                const float best = xmx[i] > mx[m] ? xmx[i] : mx[m];
                if (best <= 0.5f * NEG) continue;
                const float wa = expf(mx[m] - best), wb = expf(xmx[i] - best);
                sum[m] = sum[m] * wa + xsum[i] * wb;
                float* a = acc + (int64_t)m * D;
                for (int d = 0; d < D; d++) a[d] = a[d] * wa + xacc[i * D + d] * wb;
                mx[m] = best;
            }
        for (int m = 0; m < M; m++) {
            const float inv = sum[m] > 0.f ? 1.f / sum[m] : 0.f;
            for (int d = 0; d < D; d++) out[(bh * M + m) * D + d] = acc[(int64_t)m * D + d] * inv;
        }
    }
    return 0;
}
