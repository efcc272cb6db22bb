"""The experiments room: the demo (``demo``), multi-seed studies (``study``, ``study_report``), reports
from run directories (``report``) and training many runs at once (``runs``). Only the command line and
the ``python -m fastcov.trainer.demo`` / ``study`` entry points import it; nothing in the trainer does."""
