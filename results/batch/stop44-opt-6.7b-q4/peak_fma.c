/* The float32 multiply-add peak of one core, as the pass kernels use it (stop 44): 8 rows x 16
 * positions a tile, one broadcast multiply-add per weight, data in the caches.
 *   gcc -O3 -DMR=8 peak_fma.c -o /tmp/peak_fma -lm && /tmp/peak_fma
 *   (/tmp/peak_fma & /tmp/peak_fma & wait)   # both cores: the sum of the two mode=0 lines
 * Measured here: 58 G/s alone, 56.7 + 57.7 = 114 G/s on both cores. Not part of mlx_flash. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <math.h>
#define T __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma,f16c")))
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#ifndef MR
#define MR 8
#endif
/* y[b][n] = sum_k a[n*rs + k*ks] * x[b][k]; xt [k][16] */
T static void tile(const float *a, int64_t rs, int64_t ks, const float *xt, int64_t k, float *out) {
  __m512 acc[MR];
  for (int r=0;r<MR;r++) acc[r]=_mm512_setzero_ps();
  for (int64_t kk=0; kk<k; kk++) {
    const __m512 xv = _mm512_load_ps(xt + kk*16);
    const float *ak = a + kk*ks;
    for (int r=0;r<MR;r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(ak[r*rs]), xv, acc[r]);
  }
  for (int r=0;r<MR;r++) _mm512_storeu_ps(out + r*16, acc[r]);
}
T static void gemm(const float *a, int64_t rs, int64_t ks, const float *xt, int64_t k, int64_t n, float *y /* [16][n] */) {
  float out[MR*16];
  for (int64_t n0=0;n0<n;n0+=MR){ tile(a + n0*rs, rs, ks, xt, k, out);
    for(int r=0;r<MR;r++) for(int b=0;b<16;b++) y[b*n+n0+r]=out[r*16+b]; }
}
int main(int argc,char**argv){
  int64_t K=4096,N=256; int B=16;
  float *W=aligned_alloc(64,N*K*4),*X=aligned_alloc(64,B*K*4),*XT=aligned_alloc(64,K*16*4),*Y=aligned_alloc(64,B*N*4);
  for(int64_t i=0;i<N*K;i++)W[i]=(rand()%1000)/1000.0f-0.5f;
  for(int64_t i=0;i<B*K;i++)X[i]=(rand()%1000)/1000.0f-0.5f;
  for(int64_t k=0;k<K;k++)for(int b=0;b<16;b++)XT[k*16+b]=X[b*K+k];
  for (int mode=0; mode<2; mode++){
    int64_t rs = mode? 1 : K, ks = mode? N : 1;  /* mode 1: a is [K][N] (down) */
    float *A = W;
    if (mode){ A=aligned_alloc(64,N*K*4); for(int64_t n=0;n<N;n++)for(int64_t k=0;k<K;k++)A[k*N+n]=W[n*K+k]; }
    gemm(A,rs,ks,XT,K,N,Y);
    double err=0; for(int b=0;b<B;b++)for(int64_t n=0;n<N;n++){double s=0;for(int64_t k=0;k<K;k++)s+=(double)W[n*K+k]*X[b*K+k]; err=fmax(err,fabs(s-Y[b*N+n]));}
    int reps=200; double t=now(); for(int i=0;i<reps;i++) gemm(A,rs,ks,XT,K,N,Y); double dt=(now()-t)/reps;
    printf("MR=%d mode=%d  %.3f ms  %.1f GMAC/s (1 thread) err %.2e\n",MR,mode,dt*1e3,(double)B*N*K/dt/1e9,err);
  }
}
