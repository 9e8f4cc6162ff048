# Device-driver entry points the core resolves at run time with dlsym.
#
# Declared by hand from the vendors' public headers (CUDA 13 cuda.h, CANN
# acl_rt.h) so that building needs neither toolkit. Only the few calls the
# StreamNotifier and the batched copies make are here; each pointer type names
# the exact symbol it is looked up by (the _v2 suffixes are the ABI versions
# the headers map the plain names to).

from libc.stdint cimport int32_t, uint32_t, uint64_t

# ---- CUDA driver API (libcuda.so.1) ----------------------------------------------------

ctypedef int CUresult
ctypedef int CUdevice
ctypedef void *CUcontext
ctypedef void *CUstream
ctypedef void *CUevent
ctypedef uint64_t CUdeviceptr
ctypedef void (*CUhostFn)(void *user_data) noexcept nogil

cdef struct CUmemLocation:
    int type
    int id

cdef struct CUmemcpyAttributes:
    int srcAccessOrder
    CUmemLocation srcLocHint
    CUmemLocation dstLocHint
    unsigned int flags

ctypedef CUresult (*cuInit_t)(unsigned int flags) noexcept nogil                                   # cuInit
ctypedef CUresult (*cuGetErrorString_t)(CUresult error, const char **text) noexcept nogil           # cuGetErrorString
ctypedef CUresult (*cuGetErrorName_t)(CUresult error, const char **text) noexcept nogil             # cuGetErrorName
ctypedef CUresult (*cuDeviceGet_t)(CUdevice *device, int ordinal) noexcept nogil                    # cuDeviceGet
ctypedef CUresult (*cuDeviceGetCount_t)(int *count) noexcept nogil                                  # cuDeviceGetCount
ctypedef CUresult (*cuDevicePrimaryCtxRetain_t)(CUcontext *ctx, CUdevice device) noexcept nogil     # cuDevicePrimaryCtxRetain
ctypedef CUresult (*cuDevicePrimaryCtxRelease_t)(CUdevice device) noexcept nogil                    # cuDevicePrimaryCtxRelease_v2
ctypedef CUresult (*cuCtxPushCurrent_t)(CUcontext ctx) noexcept nogil                               # cuCtxPushCurrent_v2
ctypedef CUresult (*cuCtxPopCurrent_t)(CUcontext *ctx) noexcept nogil                               # cuCtxPopCurrent_v2
ctypedef CUresult (*cuLaunchHostFunc_t)(CUstream stream, CUhostFn fn, void *user_data) noexcept nogil  # cuLaunchHostFunc
ctypedef CUresult (*cuStreamIsCapturing_t)(CUstream stream, int *status) noexcept nogil            # cuStreamIsCapturing
ctypedef CUresult (*cuEventCreate_t)(CUevent *event, unsigned int flags) noexcept nogil             # cuEventCreate
ctypedef CUresult (*cuEventRecord_t)(CUevent event, CUstream stream) noexcept nogil                 # cuEventRecord
ctypedef CUresult (*cuEventQuery_t)(CUevent event) noexcept nogil                                   # cuEventQuery
ctypedef CUresult (*cuEventDestroy_t)(CUevent event) noexcept nogil                                 # cuEventDestroy_v2
ctypedef CUresult (*cuDeviceGetAttribute_t)(int *value, int attrib, CUdevice device) noexcept nogil  # cuDeviceGetAttribute
ctypedef CUresult (*cuMemHostGetDevicePointer_t)(CUdeviceptr *dptr, void *p, unsigned int flags) noexcept nogil  # cuMemHostGetDevicePointer_v2
# CUDA 12.8+: one call for many copies; CUDA 13 dropped the failIdx argument (the _v2 symbol).
ctypedef CUresult (*cuMemcpyBatchAsync_v2_t)(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                             CUmemcpyAttributes *attrs, size_t *attr_idxs, size_t num_attrs,
                                             CUstream stream) noexcept nogil
ctypedef CUresult (*cuMemcpyBatchAsync_v1_t)(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                             CUmemcpyAttributes *attrs, size_t *attr_idxs, size_t num_attrs,
                                             size_t *fail_idx, CUstream stream) noexcept nogil

cdef enum:
    CUDA_SUCCESS = 0
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_NOT_READY = 600
    CU_EVENT_DISABLE_TIMING = 2
    CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
    CU_MEM_LOCATION_TYPE_DEVICE = 1
    CU_MEM_LOCATION_TYPE_HOST = 2
    CU_MEMCPY_FLAG_DEFAULT = 0
    CU_STREAM_CAPTURE_STATUS_NONE = 0
    CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91

# ---- Ascend ACL runtime (libascendcl.so) -----------------------------------------------

ctypedef int aclError
ctypedef void *aclrtStream
ctypedef void *aclrtContext
ctypedef void (*aclrtCallback)(void *user_data) noexcept nogil

ctypedef aclError (*aclrtLaunchCallback_t)(aclrtCallback fn, void *user_data, int block_type,
                                          aclrtStream stream) noexcept nogil          # aclrtLaunchCallback
ctypedef aclError (*aclrtSubscribeReport_t)(uint64_t thread_id, aclrtStream stream) noexcept nogil    # aclrtSubscribeReport
ctypedef aclError (*aclrtUnSubscribeReport_t)(uint64_t thread_id, aclrtStream stream) noexcept nogil  # aclrtUnSubscribeReport
ctypedef aclError (*aclrtProcessReport_t)(int32_t timeout_ms) noexcept nogil           # aclrtProcessReport
ctypedef aclError (*aclrtGetCurrentContext_t)(aclrtContext *ctx) noexcept nogil        # aclrtGetCurrentContext
ctypedef aclError (*aclrtSetCurrentContext_t)(aclrtContext ctx) noexcept nogil         # aclrtSetCurrentContext
ctypedef const char *(*aclGetRecentErrMsg_t)() noexcept nogil                          # aclGetRecentErrMsg

cdef enum:
    ACL_SUCCESS = 0
    ACL_CALLBACK_NO_BLOCK = 0
