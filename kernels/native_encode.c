/* Per-token integer codes of new keys / values on the CPU (`native_encode.py`): the uniform cache's `quantize`
   (and, for pre-RoPE keys, the RoPE undone and the channels normalized first) in one call, bit for bit what the
   torch code computes.

   Compiled WITHOUT -ffast-math and with -ffp-contract=off: every product, sum and quotient is rounded to float32 on
   its own, in the order the torch code takes them, so the codes and scales are the same bits.

   Rows are x[R, D] float32 contiguous, R = B * H * N in (batch, head, token) order. Per row, in this order:
   1. with angles (cosv != NULL): the RoPE of the row's position undone (rotate_half layout, D / 2 frequencies):
      (x1 cos + x2 sin, x2 cos - x1 sin), then divided by `unscale` (the RoPE's attention scaling);
   2. with a frame (shift != NULL): (x - shift[h]) / scl[h] per channel;
   3. groups of `group` channels: symmetric  s = amax|x| / qmax, code = round(x / s) + qmax, qmax = 2^(bits-1) - 1;
                                  asymmetric s = (max - min) / qmax, z = min, code = round((x - z) / s), qmax = 2^bits - 1;
      the scale kept in fp16, never below the float32 one (one fp16 step up where rounding went below), at least 1e-6;
      the zero in fp16 (round to nearest; -0 as +0); codes rounded half to even, clamped;
   4. codes packed along the row, lowest channel in the lowest bits (2, 4 or 8 bits). */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "fp16_bits.h"

/* The fp16 scale of a float32 one: clamped to 1e-6, then one step up where rounding went below it. */
static half scale_half(float s) {
    if (s < 1e-6f) s = 1e-6f;
    half h = (half)s;
    if ((float)h < s) h = half_of((uint16_t)(bits_of(h) + 1));  /* positive: the next fp16 up */
    return h;
}

/* Codes of one group of n floats into q[n] (values 0..2^bits - 1); its fp16 scale (and zero) out. */
static void quantize_group(const float* g, int n, int bits, int symmetric, uint8_t* q, uint16_t* scale,
                           uint16_t* zero) {
    if (symmetric) {
        const float qmax = (float)((1 << (bits - 1)) - 1);
        float amax = 0.f;
        for (int j = 0; j < n; j++) {
            const float a = fabsf(g[j]);
            amax = a > amax ? a : amax;
        }
        const half h = scale_half(amax / qmax);
        const float s = (float)h;
        for (int j = 0; j < n; j++) {
            float r = nearbyintf(g[j] / s);
            r = r < -qmax ? -qmax : r > qmax ? qmax : r;
            q[j] = (uint8_t)(r + qmax);
        }
        *scale = bits_of(h);
        return;
    }
    const float qmax = (float)((1 << bits) - 1);
    float lo = g[0], hi = g[0];
    for (int j = 1; j < n; j++) {
        lo = g[j] < lo ? g[j] : lo;
        hi = g[j] > hi ? g[j] : hi;
    }
    const half h = scale_half((hi - lo) / qmax);
    const half z = (half)(lo + 0.f);  /* -0.0 becomes +0.0, as the torch code keeps it */
    const float s = (float)h, zf = (float)z;
    for (int j = 0; j < n; j++) {
        float r = nearbyintf((g[j] - zf) / s);
        r = r < 0.f ? 0.f : r > qmax ? qmax : r;
        q[j] = (uint8_t)r;
    }
    *scale = bits_of(h);
    *zero = bits_of(z);
}

/* Encode B * H * N rows of D channels (see the file comment). cosv, sinv [Ba, N, D / 2] (batch stride ang_sb:
   N * D / 2, or 0 when every row of the batch shares them) or NULL; shift, scl [Bf, H, D] (batch stride frame_sb:
   H * D or 0) or NULL. Out: codes [B, H, N, D * bits / 8] with element strides c_s (b, h, token), scale (and,
   asymmetric, zero) [B, H, N, D / group] fp16 bits with element strides s_s (the last dims contiguous: rows of a
   larger storage may be written in place). Returns 1 for a shape it does not take. */
int encode_tokens(const float* x, int B, int H, int N, int D, const float* cosv, const float* sinv, int64_t ang_sb,
                  float unscale, const float* shift, const float* scl, int64_t frame_sb, int bits, int group,
                  int symmetric, uint8_t* codes, int64_t c_sb, int64_t c_sh, int64_t c_st, uint16_t* scale,
                  uint16_t* zero, int64_t s_sb, int64_t s_sh, int64_t s_st) {
    if (D <= 0 || D > 1024 || D % 2 || group <= 0 || D % group || (bits != 2 && bits != 4 && bits != 8))
        return 1;
    const int per = 8 / bits, bytes = D / per, G = D / group, half_d = D / 2;
    if (D % per) return 1;
    float row[1024];
    uint8_t q[1024];
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < N; t++) {
                const int64_t r = ((int64_t)b * H + h) * N + t;
                const int64_t so = b * s_sb + h * s_sh + t * s_st;
                const float* xr = x + r * D;
                if (cosv) {
                    const float* c = cosv + b * ang_sb + (int64_t)t * half_d;
                    const float* s = sinv + b * ang_sb + (int64_t)t * half_d;
                    for (int j = 0; j < half_d; j++) {
                        const float x1 = xr[j], x2 = xr[j + half_d];
                        const float a = x1 * c[j], bb = x2 * s[j];
                        const float e = x2 * c[j], f = x1 * s[j];
                        row[j] = (a + bb) / unscale;
                        row[j + half_d] = (e - f) / unscale;
                    }
                } else {
                    memcpy(row, xr, sizeof(float) * D);
                }
                if (shift) {
                    const float* sh = shift + b * frame_sb + (int64_t)h * D;
                    const float* sc = scl + b * frame_sb + (int64_t)h * D;
                    for (int d = 0; d < D; d++) row[d] = (row[d] - sh[d]) / sc[d];
                }
                for (int g = 0; g < G; g++)
                    quantize_group(row + g * group, group, bits, symmetric, q + g * group, scale + so + g,
                                   symmetric ? 0 : zero + so + g);
                uint8_t* out = codes + b * c_sb + h * c_sh + t * c_st;
                for (int j = 0; j < bytes; j++) {
                    unsigned v = 0;
                    for (int l = 0; l < per; l++) v |= (unsigned)q[j * per + l] << (bits * l);
                    out[j] = (uint8_t)v;
                }
            }
    return 0;
}
