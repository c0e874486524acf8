"""The sub-commands of ``qwenbatch``: each module adds its parser (``add_parser``) and runs it (``run``)."""
