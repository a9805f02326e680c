"""The sparse FFN op, y = (relu(x Wg^T) * (x Wu^T)) Wd^T, one module a job:

select      which implementation runs (dense, reference, cuda) and why not the kernels
inference   the inference front: ffn_forward, ffn_add_, twell_pack
cuda_ops    the inference kernels as torch.library custom ops
training    the training front (ffn_forward_train) and its custom ops and autograd
block       the norm + FFN + residual add block op of training (ffn_block_train)
reference   the pure-PyTorch reference of both: the CPU path and the test oracle
twell       the TwELL activation format in PyTorch
checks      the input checks every implementation shares
relu_gate   the dense FFN's gate product with its sparsity statistics, in one pass
tile_plan   design 2's plan: each token tile's union of active units, on the device
"""
