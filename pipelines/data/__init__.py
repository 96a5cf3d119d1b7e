"""The data half of the pipeline: from COCO files to collated training and test batches.

``synthetic`` (the built-in dataset), ``coco`` (COCO JSON reading and validation),
``annotation_cache`` (the memory-mapped cache), ``dataset`` (images + cached annotations -> samples),
``transforms`` (resize, flip, test-time views), ``autoaug`` (Scale-aware AutoAugment), ``samplers``,
``collate``, ``loader`` and ``preview``. Nothing here imports the model, the training engine,
evaluation or tracking; functions take explicit arguments, never the params object.
"""
