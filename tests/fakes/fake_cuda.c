/* A stand-in for libcuda.so.1: the driver calls the core makes, with counters. Built by
 * tests/test_device_drivers.py; no GPU or NVIDIA driver is involved. Host functions run at once. */
#include <stdint.h>
#include <stddef.h>

typedef void (*hostfn_t)(void *);
#define CAPTURING_STREAM 0xCA

int fake_retains, fake_releases, fake_host_funcs, fake_pushes, fake_pops;

int cuInit(unsigned int flags) { return 0; }
int cuGetErrorString(int e, const char **s) { *s = "fake error"; return 0; }
int cuGetErrorName(int e, const char **s) { *s = "CUDA_ERROR_FAKE"; return 0; }
int cuDeviceGet(int *dev, int ordinal) { if (ordinal != 0) return 101; *dev = 0; return 0; }
int cuDeviceGetCount(int *n) { *n = 1; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { fake_retains++; *ctx = (void *)0x99; return 0; }
int cuDevicePrimaryCtxRelease_v2(int dev) { fake_releases++; return 0; }
int cuCtxPushCurrent_v2(void *ctx) { fake_pushes++; return ctx == (void *)0x99 ? 0 : 201; }
int cuCtxPopCurrent_v2(void **ctx) { fake_pops++; *ctx = (void *)0x99; return 0; }
int cuLaunchHostFunc(void *stream, hostfn_t fn, void *arg) { fake_host_funcs++; fn(arg); return 0; }
int cuStreamIsCapturing(void *stream, int *status) { *status = (uintptr_t)stream == CAPTURING_STREAM; return 0; }
int cuDeviceGetAttribute(int *value, int attrib, int dev) { *value = attrib == 91 ? 0 : 1; return 0; }
int cuMemHostGetDevicePointer_v2(uint64_t *dptr, void *p, unsigned int flags) {
    *dptr = (uint64_t)(uintptr_t)p + 0x100000000ULL; return 0;
}
