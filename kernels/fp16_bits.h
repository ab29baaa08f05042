/* fp16 values and their bit patterns, for the kernels that write fp16 scales bit for bit as torch does
   (`native_kivi.c`, `native_encode.c`; included by the source, hashed into its build key by `build.py`). */

#ifndef HF_KVCACHE_FP16_BITS_H
#define HF_KVCACHE_FP16_BITS_H

#include <stdint.h>
#include <string.h>

typedef _Float16 half;

static inline uint16_t bits_of(half h) {
    uint16_t u;
    memcpy(&u, &h, 2);
    return u;
}

static inline half half_of(uint16_t u) {
    half h;
    memcpy(&h, &u, 2);
    return h;
}

#endif
