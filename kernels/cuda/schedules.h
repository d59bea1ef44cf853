// The launchers of the cross-entropy schedules, one a .cu file, called by the
// dispatch (dispatch.cc) once it has chosen a schedule and filled `p` (with
// p.chunk, the elements a block or piece takes, where the schedule has one).
// Each enqueues its kernels on `stream` and returns the launch's error. Host
// code only; the kernels themselves stay in their .cu files.
#ifndef LOSSD_KERNELS_CUDA_SCHEDULES_H_
#define LOSSD_KERNELS_CUDA_SCHEDULES_H_

#include <cuda_runtime_api.h>

#include "kernels/cross_entropy.h"
#include "kernels/cuda/cross_entropy_cuda.h"
#include "kernels/cuda/launch_params.h"

namespace lossd {
namespace cuda_ce {

// prepare_finalize.cu: the target check and sums before any schedule, and
// the fixed-order reduction into *out after it.
cudaError_t LaunchPrepare(const Params& p, cudaStream_t stream);
cudaError_t LaunchFinalize(const Params& p, CrossEntropyCudaResult* out,
                           cudaStream_t stream);

// generic_rows.cu: one block a row; any alignment, any options.
cudaError_t LaunchGenericRows(const Params& p, DType dtype,
                              cudaStream_t stream);

// cluster_register_rows.cu: clusters of `cluster` blocks a row, each holding
// p.chunk = vectors_per_thread * 256 * vector width elements in registers
// (vectors_per_thread 1, 2, 4, 8 or 16); `general` adds softcap, class
// weights and label smoothing. 16-byte aligned rows. Every other launcher
// takes every option: it picks its option build (ElementOptionsOn).
cudaError_t LaunchClusterRegisterRows(const Params& p, DType dtype,
                                      bool general, int vectors_per_thread,
                                      int cluster, cudaStream_t stream);

// cluster_stream_rows.cu: persistent clusters of `cluster` blocks, p.chunk
// elements each (a multiple of 256 vectors); 16-byte aligned
// rows, any vocab.
cudaError_t LaunchClusterStreamRows(const Params& p, DType dtype, int cluster,
                                    cudaStream_t stream);

// cluster_slice_rows.cu: persistent clusters of `cluster` (<= 16) blocks of
// 256 threads, two a SM, p.chunk elements each kept in shared memory; rows
// and vocab in whole 16-byte vectors.
// cudaErrorInvalidConfiguration when fewer than two slices fit a block.
cudaError_t LaunchClusterSliceRows(const Params& p, DType dtype, int cluster,
                                   cudaStream_t stream);

// split_row_forward.cu: forward only; `pieces` (<= kMaxPieces) blocks a row of
// p.chunk elements each, merged by a second kernel; rows * pieces <= INT_MAX.
// `edges`: rows of any alignment and vocab (as smem row pieces); else rows and
// vocab in whole 16-byte vectors.
cudaError_t LaunchSplitRowForward(const Params& p, DType dtype, bool edges,
                                  int pieces, cudaStream_t stream);

// l2_row_pieces.cu: forward+gradient of 2-byte logits (kBFloat16,
// kFloat16), `pieces` pieces of p.chunk elements a row, groups of
// `group_rows` rows, the statistics two groups ahead of the gradient.
cudaError_t LaunchL2RowPieces(const Params& p, DType dtype, int pieces,
                              int group_rows, cudaStream_t stream);

// smem_row_pieces.cu: forward+gradient, `pieces` (<= kMaxPieces) pieces of
// p.chunk elements a row, each kept in a block's shared memory. `bulk`: the
// TMA unit brings a piece in (else the threads' loads: 2-byte logits of
// whole-vector rows only).
// `edges`: rows of any alignment and vocab (the gradient at the same offset
// from a 16-byte boundary as the logits); else 16-byte aligned rows of whole
// vectors.
// SmemRowPiecesFit says whether this device can run that shape (a piece fits
// a block's shared memory, and enough blocks are resident for a row's pieces
// to wait for each other); the launcher returns cudaErrorInvalidConfiguration
// where it cannot.
cudaError_t SmemRowPiecesFit(const Params& p, DType dtype, bool bulk,
                             bool edges, int pieces, bool* fits);
cudaError_t LaunchSmemRowPieces(const Params& p, DType dtype, bool bulk,
                                bool edges, int pieces, cudaStream_t stream);

}  // namespace cuda_ce
}  // namespace lossd

#endif  // LOSSD_KERNELS_CUDA_SCHEDULES_H_
