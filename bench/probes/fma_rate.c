/* The FMA rate each thread gets: 8 independent chains of 512-bit FMAs per
 * OpenMP thread, 200 M iterations; G FMA instructions a second per thread.
 * Session 16 ran it beside a plain read (read_streams.c) and bench_matvec
 * every few seconds to tell the host's phases apart: in minutes when
 * bench_matvec at 2 threads fell from 50-65 to 21-31 GB/s, the FMA rate per
 * thread read 4.8-7.9 (mostly 6.5-7.9; 1 thread 6.7-8.1) and the plain read
 * 41-76: the arithmetic did not halve as the products did
 * (bench/RESULTS-decode.md, session 16).
 *   gcc -O2 -mavx512f -mfma -fopenmp bench/probes/fma_rate.c -o /tmp/fma_rate
 *   OMP_NUM_THREADS=2 /tmp/fma_rate */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* 8 independent FMA chains per thread, 20M iterations: GFMA/s per thread (zmm FMAs) */
int main(void){ double t0=now(); float z=0;
#pragma omp parallel reduction(+:z)
 { __m512 a0=_mm512_set1_ps(1),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0,m=_mm512_set1_ps(0.999999f),c=_mm512_set1_ps(1e-7f);
   for(long i=0;i<200000000;i++){a0=_mm512_fmadd_ps(a0,m,c);a1=_mm512_fmadd_ps(a1,m,c);a2=_mm512_fmadd_ps(a2,m,c);a3=_mm512_fmadd_ps(a3,m,c);a4=_mm512_fmadd_ps(a4,m,c);a5=_mm512_fmadd_ps(a5,m,c);a6=_mm512_fmadd_ps(a6,m,c);a7=_mm512_fmadd_ps(a7,m,c);}
   z+=_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)),_mm512_add_ps(_mm512_add_ps(a4,a5),_mm512_add_ps(a6,a7))));}
 double t=now()-t0; printf("T%d fma: %.2f G zmm-FMA/s per thread (%.3f s)%s\n",omp_get_max_threads(),1600e6/t/1e9,t,z<0?"!":""); }
