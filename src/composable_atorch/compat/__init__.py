"""ATorch compatibility: ``auto_accelerate`` as a thin facade (``atorch``) over strategies, the search
and plans, and the checked request its keywords become (``request``).
"""
