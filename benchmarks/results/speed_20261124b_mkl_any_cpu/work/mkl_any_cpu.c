/* Answers Intel MKL's CPU-vendor check with "Intel", so that MKL picks its
   kernels by instruction set on any x86 CPU (pockjax bench --torch-mkl-any-cpu). */
int mkl_serv_intel_cpu_true(void) { return 1; }
