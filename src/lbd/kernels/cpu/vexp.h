/* exp(x) for x <= 0 in AVX-512, shared by the kernels that need a vector exp (softmax, SiLU). */
#ifndef LBD_VEXP_H
#define LBD_VEXP_H
#if defined(__AVX512F__)
#include <immintrin.h>

/* exp(x) for x <= 0 (softmax inputs after the max is subtracted): x = n ln2 + r, |r| <= ln2/2, and
 * exp(r) by Cephes' degree-7 polynomial (~1 ulp). libm's expf is scalar here (glibc's vector variants are
 * declared only under -ffast-math) and took a quarter of the kernel's time. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));  /* below this exp is 0 in fp32 anyway */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}
#endif
#endif
