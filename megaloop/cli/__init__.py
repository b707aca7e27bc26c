"""The ``megaloop`` command: one console entry point whose subcommands are the tools
(megaloop/cli/main.py has the table). Each subcommand's module here holds its parser and its
``main``; ``tools/<name>.py`` are thin scripts over them for a checkout that is not installed,
and training stays Megatron-LM's ``torchrun pretrain_looplm.py [flags]``."""
