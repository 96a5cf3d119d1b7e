"""The code file of the logged MLflow model (models-from-code): MLflow runs it when it loads the model.

It only names the model object, a :class:`~pipelines.inference.served.ServedDetector`; nothing is
pickled. The import is absolute: MLflow runs this file on its own, with the model's ``code`` folder (the
torch-free modules of :func:`pipelines.inference.registration.code_files`) first on ``sys.path``.
"""

from mlflow.models import set_model

from pipelines.inference.served import ServedDetector

set_model(ServedDetector())
