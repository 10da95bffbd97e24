/* Does libxsmm (Debian libxsmm-dev 1.17) JIT a bf16 GEMM on this CPU, and at
 * what rate? Not built by CMake (libxsmm is not a dependency of qtune):
 *   gcc -O2 bench/probes/xsmm_bf16_probe.c -o /tmp/xsmm_probe -lxsmm -lblas -lm -ldl -lpthread && /tmp/xsmm_probe
 * Result on the development machine: bench/RESULTS-precision.md. */
#include <libxsmm.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double cpu(void){struct timespec t;clock_gettime(CLOCK_PROCESS_CPUTIME_ID,&t);return t.tv_sec+1e-9*t.tv_nsec;}
int main(void){
  libxsmm_init();
  printf("libxsmm target arch: %s\n", libxsmm_get_target_arch());
  int m=64,n=64,k=64; float alpha=1,beta=1;
  libxsmm_bsmmfunction f = libxsmm_bsmmdispatch(m,n,k,NULL,NULL,NULL,&alpha,&beta,NULL,NULL);
  libxsmm_smmfunction fs = libxsmm_smmdispatch(m,n,k,NULL,NULL,NULL,&alpha,&beta,NULL,NULL);
  printf("bf16 (bsmm, bf16 in, fp32 acc) 64x64x64 kernel: %s\n", f? "JIT ok":"NULL (not available on this CPU)");
  printf("fp32 smm 64x64x64 kernel: %s\n", fs? "JIT ok":"NULL");
  libxsmm_bfloat16 *a=calloc(m*k,2),*b=calloc(k*n,2); float *c=calloc(m*n,4), *af=calloc(m*k,4), *bf=calloc(k*n,4);
  for(int i=0;i<m*k;i++){float x=(float)(i%7)*0.25f; af[i]=x; unsigned u; memcpy(&u,&x,4); a[i]=(libxsmm_bfloat16)(u>>16);}
  for(int i=0;i<k*n;i++){float x=(float)(i%5)*0.5f; bf[i]=x; unsigned u; memcpy(&u,&x,4); b[i]=(libxsmm_bfloat16)(u>>16);}
  int reps=20000;
  if(f){ double t=cpu(); for(int r=0;r<reps;r++) f(a,b,c); t=cpu()-t; printf("bf16 bsmm: %.1f GFLOP per CPU-s\n", 2.0*m*n*k*reps/t/1e9);}
  if(fs){ double t=cpu(); for(int r=0;r<reps;r++) fs(af,bf,c); t=cpu()-t; printf("fp32 smm:  %.1f GFLOP per CPU-s\n", 2.0*m*n*k*reps/t/1e9);}
  libxsmm_finalize(); return 0;}
