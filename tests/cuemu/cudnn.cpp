/*
 * cudnn.cpp — cuemu's cuDNN: absent. cudnnCreate fails with a message, so
 * kernels/cuda/attention.cu takes its documented path for a machine
 * without usable cuDNN (logged once, the CUDA fallback kernels serve every
 * call), and that path is what the emulation tests. The SDPA graphs need
 * the GPU itself.
 */
#include <cudnn.h>
#include <string.h>

extern "C" {

size_t cudnnGetVersion(void) { return 0; }

const char *cudnnGetErrorString(cudnnStatus_t s) {
  return s == CUDNN_STATUS_SUCCESS ? "CUDNN_STATUS_SUCCESS" : "CUDNN_STATUS_NOT_SUPPORTED";
}

void cudnnGetLastErrorString(char *message, size_t max_size) {
  if (max_size == 0) return;
  strncpy(message, "cuDNN is not emulated by cuemu", max_size - 1);
  message[max_size - 1] = 0;
}

cudnnStatus_t cudnnCreate(cudnnHandle_t *h) {
  *h = NULL;
  return CUDNN_STATUS_NOT_SUPPORTED;
}
cudnnStatus_t cudnnDestroy(cudnnHandle_t) { return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t cudnnSetStream(cudnnHandle_t, cudaStream_t) { return CUDNN_STATUS_NOT_SUPPORTED; }
cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t, cudnnBackendDescriptor_t *d) {
  *d = NULL;
  return CUDNN_STATUS_NOT_SUPPORTED;
}
cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t) { return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t) { return CUDNN_STATUS_NOT_SUPPORTED; }
cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t,
                                       cudnnBackendAttributeType_t, int64_t, const void *) {
  return CUDNN_STATUS_NOT_SUPPORTED;
}
cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t const, cudnnBackendAttributeName_t,
                                       cudnnBackendAttributeType_t, int64_t, int64_t *count, void *) {
  if (count) *count = 0;
  return CUDNN_STATUS_NOT_SUPPORTED;
}
cudnnStatus_t cudnnBackendExecute(cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t) {
  return CUDNN_STATUS_NOT_SUPPORTED;
}

}  // extern "C"
