/* KIVI codes on the CPU (`native_kivi.py`), bit for bit what quant/kivi.py's torch code computes: one clip
   candidate of a tensor's groups per call (`kivi_candidate`) and the packing of quant/packing.py (`pack_codes`).

   Compiled WITHOUT -ffast-math and with -ffp-contract=off (at -O3: vectorized, each lane rounding as the scalar code
   would): every product, sum and quotient is rounded to float32 on its own, in the order the torch code takes them. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp16_bits.h"

/* One KIVI clipping candidate (quant/kivi.py's `quantize_kivi`), bit for bit what its torch code computes. x[A][G][C]
   float32 in groups of G (keys per channel: A groups of tokens, C channels; values per token: A groups of channels,
   C = 1), each group's extent lo / hi [A][C]. Per group: the range shrunk about its midpoint, mid = (hi + lo) * 0.5,
   half = (hi - lo) * half_ratio, [mid - half, mid + half] (half_ratio < 0: the extent as it is); the fp16 scale of
   (range) / qmax (at least 1e-6, one fp16 step up where rounding went below) and the fp16 zero (the range's low end).
   Per element: code = clamp(round((x - z) / s), 0, qmax) (half to even) with s, z those fp16 values as float32.
   Out (each may be NULL): the range r_lo / r_hi [A][C]; scale16 / zero16 [A][C] (fp16 bits); err[A][G][C] =
   (code * s + z - x)^2, which the torch code sums per group; codes[A][G][C] as bytes. Returns 1 when out of memory. */
static inline float kivi_code(float x, float s, float z, float qmax) {
    const float r = nearbyintf((x - z) / s);
    return r < 0.f ? 0.f : r > qmax ? qmax : r;
}

static half kivi_scale(float s) {
    const float c = s < 1e-6f ? 1e-6f : s;  /* NaN stays NaN, as torch's clamp_min keeps it */
    half h = (half)c;
    if ((float)h < s) h = half_of((uint16_t)(bits_of(h) + 1));  /* compared with the unclamped scale */
    return h;
}

int kivi_candidate(const float* x, const float* lo, const float* hi, int64_t A, int64_t G, int64_t C,
                   float half_ratio, float qmax, float* r_lo, float* r_hi, uint16_t* scale16, uint16_t* zero16,
                   float* err, uint8_t* codes) {
    const int64_t n = A * C;
    float* sz = (float*)malloc(sizeof(float) * 2 * (size_t)(n > 0 ? n : 1));
    if (!sz) return 1;
    float *s = sz, *z = sz + n;
    for (int64_t i = 0; i < n; i++) {
        float l = lo[i], u = hi[i];
        if (half_ratio >= 0.f) {
            const float mid = (u + l) * 0.5f, hr = (u - l) * half_ratio;
            l = mid - hr;
            u = mid + hr;
        }
        const half hs = kivi_scale((u - l) / qmax), hz = (half)l;
        s[i] = (float)hs;
        z[i] = (float)hz;
        if (r_lo) r_lo[i] = l;
        if (r_hi) r_hi[i] = u;
        if (scale16) scale16[i] = bits_of(hs);
        if (zero16) zero16[i] = bits_of(hz);
    }
    for (int64_t a = 0; a < A; a++) {
        const float* sa = s + a * C;
        const float* za = z + a * C;
        const int64_t o = a * G * C;
        if (C == 1) {  /* one scale for the whole group: a loop over its G contiguous elements */
            const float sv = sa[0], zv = za[0];
            const float* xa = x + o;
            if (err) {
                float* ea = err + o;
                for (int64_t j = 0; j < G; j++) {
                    const float e = kivi_code(xa[j], sv, zv, qmax) * sv + zv - xa[j];
                    ea[j] = e * e;
                }
            }
            if (codes)
                for (int64_t j = 0; j < G; j++) codes[o + j] = (uint8_t)kivi_code(xa[j], sv, zv, qmax);
            continue;
        }
        for (int64_t j = 0; j < G; j++) {
            const float* xr = x + o + j * C;
            if (err) {
                float* er = err + o + j * C;
                for (int64_t c = 0; c < C; c++) {
                    const float e = kivi_code(xr[c], sa[c], za[c], qmax) * sa[c] + za[c] - xr[c];
                    er[c] = e * e;
                }
            }
            if (codes) {
                uint8_t* qr = codes + o + j * C;
                for (int64_t c = 0; c < C; c++) qr[c] = (uint8_t)kivi_code(xr[c], sa[c], za[c], qmax);
            }
        }
    }
    free(sz);
    return 0;
}

/* Codes q[R][n] (bytes) packed along each row at `bits` (1, 2 or 4), lowest code in the lowest bits, the last byte's
   missing codes taken as 0: out[R][ceil(n * bits / 8)], what quant/packing.py's `pack_bits` computes (each code
   shifted as a byte, the bytes of a group summed modulo 256). */
void pack_codes(const uint8_t* q, int64_t R, int64_t n, int bits, uint8_t* out) {
    const int per = 8 / bits;
    const int64_t bytes = (n + per - 1) / per, whole = n / per;
    for (int64_t r = 0; r < R; r++) {
        const uint8_t* qr = q + r * n;
        uint8_t* o = out + r * bytes;
        for (int64_t j = 0; j < whole; j++) {
            unsigned v = 0;
            for (int l = 0; l < per; l++) v += (uint8_t)(qr[j * per + l] << (bits * l));
            o[j] = (uint8_t)v;
        }
        if (whole < bytes) {
            unsigned v = 0;
            for (int l = 0; whole * per + l < n; l++) v += (uint8_t)(qr[whole * per + l] << (bits * l));
            o[whole] = (uint8_t)v;
        }
    }
}
