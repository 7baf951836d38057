"""cuDNN's FP8 attention: the live target (:mod:`dmref.cudnn.target`, ``cudnn_fp8``: cuDNN's fused
FP8 forward and backward through ``nvidia-cudnn-frontend``, as the oracle calls it) and the
replay of a capture on the CPU (:mod:`dmref.cudnn.replay`, ``dmref verify-attention``). Importing
either needs neither the frontend nor a GPU."""
