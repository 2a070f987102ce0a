# Package holding the files vendored from transformers 5.24.0 (see ../README.md). Kept empty on purpose:
# test_configuration_common.py executes this file as a throwaway module (direct_transformers_import).
