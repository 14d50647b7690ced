from .tensor_parallel import all_gather_matmul, copy_to_tp_matmul, matmul_all_reduce, matmul_reduce_scatter
