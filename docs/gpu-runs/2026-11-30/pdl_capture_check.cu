// Which CUDA runtime calls a custom-call handler may make while XLA captures its
// stream into a command buffer (CUDA graph), and whether a kernel launched with
// programmatic dependent launch (PDL) survives capture into a child graph.
//   nvcc -arch=sm_90 -o pdl_capture_check pdl_capture_check.cu && ./pdl_capture_check
// what=0: a PDL launch; 1: cudaStreamGetDevice; 2: an occupancy query;
// 3: cudaGetDevice + cudaDeviceGetAttribute. For each capture mode, with
// cudaStreamBeginCapture and cudaStreamBeginCaptureToGraph; the captured graph
// is added as a child node (as XLA does), instantiated and run.
// y = 2016 (the sum of 0..63) means the PDL kernel waited for the one before it.
#include <cuda_runtime.h>

#include <cstdio>

__global__ void Primary(int* x) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (threadIdx.x == 0) x[blockIdx.x] = blockIdx.x;
}

__global__ void Secondary(const int* x, int* y) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    int s = 0;
    for (int i = 0; i < 64; ++i) s += x[i];
    *y = s;
  }
}

__global__ void Other(int* y) {
  if (threadIdx.x == 0) *y += 1;
}

static void Print(const char* what, cudaError_t e) {
  std::printf("%-40s %s\n", what, cudaGetErrorName(e));
}

static cudaError_t LaunchSecondary(cudaStream_t s, const int* x, int* y) {
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(64);
  c.blockDim = dim3(128);
  c.stream = s;
  cudaLaunchAttribute a[1];
  a[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a[0].val.programmaticStreamSerializationAllowed = 1;
  c.attrs = a;
  c.numAttrs = 1;
  return cudaLaunchKernelEx(&c, Secondary, x, y);
}

static void Try(const char* name, cudaStreamCaptureMode mode, bool to_graph, int what) {
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  int *x, *y;
  cudaMalloc(&x, 256);
  cudaMalloc(&y, 4);
  cudaGraph_t g = nullptr;
  cudaGraphCreate(&g, 0);
  Print("begin", to_graph ? cudaStreamBeginCaptureToGraph(s, g, nullptr, nullptr, 0, mode)
                          : cudaStreamBeginCapture(s, mode));
  Primary<<<64, 128, 0, s>>>(x);
  if (what == 0) Print(name, LaunchSecondary(s, x, y));
  if (what == 1) { int d = -1; Print(name, cudaStreamGetDevice(s, &d)); }
  if (what == 2) { int n = 0; Print(name, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Other, 256, 0)); }
  if (what == 3) {
    int d = -1, m = 0;
    Print(name, cudaGetDevice(&d));
    Print("  attr", cudaDeviceGetAttribute(&m, cudaDevAttrMultiProcessorCount, d));
  }
  cudaGraph_t out = nullptr;
  Print("  end", cudaStreamEndCapture(s, &out));
  if (out) {
    cudaGraph_t parent;
    cudaGraphCreate(&parent, 0);
    cudaGraphNode_t n;
    Print("  child node", cudaGraphAddChildGraphNode(&n, parent, nullptr, 0, out));
    cudaGraphExec_t ex;
    Print("  instantiate parent", cudaGraphInstantiate(&ex, parent, 0));
    Print("  launch", cudaGraphLaunch(ex, s));
    Print("  sync", cudaStreamSynchronize(s));
    int h = 0;
    cudaMemcpy(&h, y, 4, cudaMemcpyDeviceToHost);
    std::printf("  y=%d (want 2016 for pdl)\n", h);
  }
  cudaGetLastError();
}

int main() {
  cudaFree(0);
  const char* names[] = {"global", "threadlocal", "relaxed"};
  cudaStreamCaptureMode modes[] = {cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal,
                                   cudaStreamCaptureModeRelaxed};
  for (int what = 0; what < 4; ++what) {
    for (int i = 0; i < 3; ++i) {
      for (int to_graph = 0; to_graph < 2; ++to_graph) {
        char name[128];
        std::snprintf(name, sizeof name, "what=%d mode=%s to_graph=%d", what, names[i], to_graph);
        std::printf("== %s\n", name);
        Try(name, modes[i], to_graph, what);
      }
    }
  }
  cudaStream_t s;
  cudaStreamCreate(&s);
  int *x, *y;
  cudaMalloc(&x, 256);
  cudaMalloc(&y, 4);
  Primary<<<64, 128, 0, s>>>(x);
  Print("eager pdl", LaunchSecondary(s, x, y));
  Print("eager sync", cudaStreamSynchronize(s));
}
