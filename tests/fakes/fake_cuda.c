/* A stand-in for libcuda.so.1: the driver calls the core makes, with counters. Built by
 * tests/test_device_drivers.py and tests/test_device_vmm.py; no GPU or NVIDIA driver is involved.
 * Host functions run at once. "Device memory" of the VMM calls is a memfd: cuMemCreate makes one,
 * cuMemExportToShareableHandle dups its fd, cuMemMap maps it at a reserved range and cuMemSetAccess
 * turns the access flags into page protections, so a read-only import really is read-only here. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/mman.h>
#include <sys/stat.h>

typedef void (*hostfn_t)(void *);
#define CAPTURING_STREAM 0xCA

int fake_retains, fake_releases, fake_host_funcs, fake_pushes, fake_pops;
/* VMM: what the tests set (device count, attribute 102/103 values, P2P, errors to return) and count. */
int fake_device_count = 1, fake_vmm = 1, fake_posix_fd = 1, fake_peer_access = 1;
int fake_import_error, fake_access_error, fake_create_error;
int fake_creates, fake_mem_releases, fake_exports, fake_imports, fake_reserves, fake_frees, fake_maps, fake_unmaps;
int fake_access_calls;  /* cuMemSetAccess calls, refused or not */
int fake_last_create_device = -1;
int fake_last_access_flags = -1, fake_last_access_device = -1;

int cuInit(unsigned int flags) { return 0; }
int cuGetErrorString(int e, const char **s) { *s = "fake error"; return 0; }
int cuGetErrorName(int e, const char **s) { *s = "CUDA_ERROR_FAKE"; return 0; }
int cuDeviceGet(int *dev, int ordinal) { if (ordinal < 0 || ordinal >= fake_device_count) return 101; *dev = ordinal; return 0; }
int cuDeviceGetCount(int *n) { *n = fake_device_count; return 0; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { fake_retains++; *ctx = (void *)0x99; return 0; }
int cuDevicePrimaryCtxRelease_v2(int dev) { fake_releases++; return 0; }
int cuCtxPushCurrent_v2(void *ctx) { fake_pushes++; return ctx == (void *)0x99 ? 0 : 201; }
int cuCtxPopCurrent_v2(void **ctx) { fake_pops++; *ctx = (void *)0x99; return 0; }
/* Host functions run at once, or with fake_defer_host_funcs set are held until fake_run_host_funcs(). */
int fake_defer_host_funcs, fake_held_host_funcs;
static hostfn_t held_fn[256];
static void *held_arg[256];
int fake_launch_delay_us; /* the launch returns this long after running the host function (a slow driver) */
int cuLaunchHostFunc(void *stream, hostfn_t fn, void *arg) {
    __atomic_add_fetch(&fake_host_funcs, 1, __ATOMIC_SEQ_CST);
    if (!fake_defer_host_funcs) { fn(arg); if (fake_launch_delay_us) usleep(fake_launch_delay_us); return 0; }
    if (fake_held_host_funcs == 256) return 2;
    held_fn[fake_held_host_funcs] = fn; held_arg[fake_held_host_funcs] = arg; fake_held_host_funcs++;
    return 0;
}
int fake_run_host_funcs(void) {
    int n = fake_held_host_funcs;
    for (int i = 0; i < n; i++) held_fn[i](held_arg[i]);
    fake_held_host_funcs = 0;
    return n;
}
/* Events: each record takes the next number of one device-wide sequence; an event is complete once the
 * test has set fake_device_done to its number or more, or fake_done_also to its number (another stream
 * that got there first). fake_query_error makes every query fail. */
typedef struct { long seq; } event_t;
long fake_enqueued, fake_device_done, fake_done_also = -1;
int fake_events, fake_event_destroys, fake_event_queries, fake_query_error, fake_no_events;
int cuEventCreate(event_t **ev, unsigned int flags) {
    if (fake_no_events) return 1;
    *ev = calloc(1, sizeof(event_t)); __atomic_add_fetch(&fake_events, 1, __ATOMIC_SEQ_CST); return 0;
}
int cuEventRecord(event_t *ev, void *stream) { ev->seq = __atomic_add_fetch(&fake_enqueued, 1, __ATOMIC_SEQ_CST); return 0; }
int cuEventQuery(event_t *ev) {
    __atomic_add_fetch(&fake_event_queries, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&fake_query_error, __ATOMIC_SEQ_CST)) return 999;
    return ev->seq <= __atomic_load_n(&fake_device_done, __ATOMIC_SEQ_CST)
        || ev->seq == __atomic_load_n(&fake_done_also, __ATOMIC_SEQ_CST) ? 0 : 600;
}
int cuEventDestroy_v2(event_t *ev) { free(ev); __atomic_add_fetch(&fake_event_destroys, 1, __ATOMIC_SEQ_CST); return 0; }
int cuStreamIsCapturing(void *stream, int *status) { *status = (uintptr_t)stream == CAPTURING_STREAM; return 0; }
int cuDeviceGetAttribute(int *value, int attrib, int dev) {
    *value = attrib == 91 ? 0 : attrib == 102 ? fake_vmm : attrib == 103 ? fake_posix_fd : 1; return 0;
}
int cuMemHostGetDevicePointer_v2(uint64_t *dptr, void *p, unsigned int flags) {
    *dptr = (uint64_t)(uintptr_t)p + 0x100000000ULL; return 0;
}

typedef struct { int type, id; } loc_t;
typedef struct { int type, handle_types; loc_t location; void *win32; unsigned char flags[8]; } prop_t;
typedef struct { loc_t location; int flags; } access_t;
typedef struct { int fd; size_t size; } mem_t;
#define GRANULARITY 65536

int cuDeviceGetUuid(char *uuid, int dev) { memset(uuid, 0, 16); memcpy(uuid, "fake-gpu-uuid-", 14); uuid[14] = (char)dev; return 0; }
int cuDeviceCanAccessPeer(int *can, int dev, int peer) { *can = fake_peer_access; return 0; }
int cuMemGetAllocationGranularity(size_t *g, const prop_t *prop, int option) { *g = GRANULARITY; return 0; }

int cuMemCreate(uint64_t *handle, size_t size, const prop_t *prop, unsigned long long flags) {
    if (fake_create_error) return fake_create_error;
    if (size % GRANULARITY || prop->type != 1 || prop->location.type != 1) return 1;
    if (prop->location.id < 0 || prop->location.id >= fake_device_count) return 101;
    int fd = memfd_create("fake_cuda", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, size) != 0) return 2;
    mem_t *m = malloc(sizeof *m); m->fd = fd; m->size = size; *handle = (uint64_t)(uintptr_t)m;
    fake_last_create_device = prop->location.id;
    fake_creates++; return 0;
}
int cuMemRelease(uint64_t handle) { mem_t *m = (mem_t *)(uintptr_t)handle; close(m->fd); free(m); fake_mem_releases++; return 0; }
int cuMemExportToShareableHandle(void *out, uint64_t handle, int type, unsigned long long flags) {
    if (type != 1) return 1;
    mem_t *m = (mem_t *)(uintptr_t)handle; *(int *)out = dup(m->fd); fake_exports++; return 0;
}
int cuMemImportFromShareableHandle(uint64_t *handle, void *os_handle, int type) {
    if (fake_import_error) return fake_import_error;
    struct stat st; int fd = (int)(intptr_t)os_handle;
    if (type != 1 || fstat(fd, &st) != 0) return 1;
    mem_t *m = malloc(sizeof *m); m->fd = dup(fd); m->size = st.st_size; *handle = (uint64_t)(uintptr_t)m;
    fake_imports++; return 0;
}
int cuMemAddressReserve(uint64_t *ptr, size_t size, size_t align, uint64_t addr, unsigned long long flags) {
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return 2;
    *ptr = (uint64_t)(uintptr_t)p; fake_reserves++; return 0;
}
int cuMemAddressFree(uint64_t ptr, size_t size) { munmap((void *)(uintptr_t)ptr, size); fake_frees++; return 0; }
int cuMemMap(uint64_t ptr, size_t size, size_t offset, uint64_t handle, unsigned long long flags) {
    mem_t *m = (mem_t *)(uintptr_t)handle;
    if (offset + size > m->size) return 1;  /* CUDA_ERROR_INVALID_VALUE: more than the allocation holds */
    if (mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, m->fd, offset) == MAP_FAILED) return 1;
    fake_maps++; return 0;
}
int cuMemUnmap(uint64_t ptr, size_t size) {
    mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    fake_unmaps++; return 0;
}
int cuMemSetAccess(uint64_t ptr, size_t size, const access_t *desc, size_t count) {
    fake_access_calls++;
    if (fake_access_error) return fake_access_error;
    if (count != 1 || desc->location.type != 1 || desc->location.id >= fake_device_count) return 1;
    fake_last_access_flags = desc->flags; fake_last_access_device = desc->location.id;
    int prot = desc->flags == 3 ? PROT_READ | PROT_WRITE : desc->flags == 1 ? PROT_READ : PROT_NONE;
    return mprotect((void *)(uintptr_t)ptr, size, prot) == 0 ? 0 : 1;
}
