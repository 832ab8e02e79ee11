"""What runs while a plan trains: the parallel layout and its process groups (``layout``, ``mesh``),
the optimizer API every plan shares (``optim``), loader rebuilding (``loader``), meta-device model
recording (``record_init``), the resumable data position (``resumable``) and ``train_step``.
"""
