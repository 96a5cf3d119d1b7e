"""Using a trained detector outside training: backends, sources, predictions, and the export to ONNX
with its torch-free runtime (decode, resize and pad; ONNX Runtime; FCOS post-processing in numpy)."""
