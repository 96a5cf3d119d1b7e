"""Inference outside training: the detector's network exported to ONNX with its model card, and the
torch-free path that runs it (decode, resize and pad; ONNX Runtime; post-processing with torchvision's
FCOS semantics)."""
