/* Scores of grouped queries against pre-RoPE keys rebuilt from subspace coefficients (the tiered cache's subspace
 * archive, `native_subspace.py`): for each token, key = mean + z @ W (W: the basis times sigma, [rank, D]), RoPE put
 * back with the given cos / sin of its position, then one dot per query row. A key lives in L1 for the rebuild, the
 * turn and the dots, where the torch path writes and rereads every rebuilt and turned key. */

#define TILE 32
#define MAXDIM 256

static inline void tile_scores(const float *z, const float *w, const float *mean, const float *cos_t,
                               const float *sin_t, const float *q, float *out, int tokens, int rank, int rows,
                               int t0, int n, float scale, const int dim) {
    const int half = dim / 2;
    float key[MAXDIM];
    for (int t = t0; t < t0 + n; t++) {
        const float *zt = z + (long)t * rank;
        for (int d = 0; d < dim; d++) key[d] = mean[d];
        for (int j = 0; j < rank; j++) {
            const float c = zt[j];
            const float *wj = w + (long)j * dim;
#pragma omp simd
            for (int d = 0; d < dim; d++) key[d] += c * wj[d];
        }
        const float *ct = cos_t + (long)t * half, *st = sin_t + (long)t * half;
#pragma omp simd
        for (int i = 0; i < half; i++) {
            const float x1 = key[i], x2 = key[i + half];
            key[i] = x1 * ct[i] - x2 * st[i];
            key[i + half] = x2 * ct[i] + x1 * st[i];
        }
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
