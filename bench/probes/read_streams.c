/* A plain read of 1 GiB (anonymous, huge pages) by every OpenMP thread, each
 * thread reading its contiguous share in chunks of C KiB, each chunk as S
 * streams side by side (S = 1, 2 or 4): the access pattern of op_matvec.c's
 * one-row tile with no arithmetic, for comparing the kernel with what the
 * memory gives that pattern. Best of 6 passes.
 *   gcc -O2 -mavx512f -fopenmp bench/probes/read_streams.c -o /tmp/read_streams
 *   OMP_NUM_THREADS=2 /tmp/read_streams S C_KIB */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
/* each thread's region read in chunks of C bytes, each chunk as S streams (equal parts) */
int main(int argc,char**argv){
  size_t bytes=(size_t)1<<30, n=bytes/4; int S=atoi(argv[1]); size_t C=(size_t)atol(argv[2])<<10;
  float*a=mmap(0,bytes+(4<<21),PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  a=(float*)(((size_t)a+(1<<21)-1)&~((size_t)(1<<21)-1)); madvise(a,bytes,MADV_HUGEPAGE);
  for(size_t i=0;i<n;i++)a[i]=1.0f;
  double best=1e9; float z=0; size_t cf=C/4;
  for(int r=0;r<6;r++){
    double t0=now();
    #pragma omp parallel reduction(+:z)
    { int t=omp_get_thread_num(), T=omp_get_num_threads(); size_t per=n/T, b=t*per;
      __m512 s0=_mm512_setzero_ps(),s1=s0,s2=s0,s3=s0;
      for(size_t c0=0;c0+cf<=per;c0+=cf){ const float*p=a+b+c0; size_t ps=cf/S/16*16;
        if(S==1) for(size_t i=0;i<cf;i+=32){s0=_mm512_add_ps(s0,_mm512_load_ps(p+i));s1=_mm512_add_ps(s1,_mm512_load_ps(p+i+16));}
        else if(S==2) for(size_t i=0;i<ps;i+=16){s0=_mm512_add_ps(s0,_mm512_load_ps(p+i));s1=_mm512_add_ps(s1,_mm512_load_ps(p+ps+i));}
        else for(size_t i=0;i<ps;i+=16){s0=_mm512_add_ps(s0,_mm512_load_ps(p+i));s1=_mm512_add_ps(s1,_mm512_load_ps(p+ps+i));s2=_mm512_add_ps(s2,_mm512_load_ps(p+2*ps+i));s3=_mm512_add_ps(s3,_mm512_load_ps(p+3*ps+i));}
      }
      z+=_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0,s1),_mm512_add_ps(s2,s3)));}
    double t=now()-t0; if(t<best)best=t;}
  printf("T%d S%d chunk %zu KiB: %.1f GB/s\n",omp_get_max_threads(),S,C>>10,bytes/best/1e9);
  if(z<0)puts("");
}
