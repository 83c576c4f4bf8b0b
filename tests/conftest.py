import os

from harness.distributed import DEVICE_ENV_VAR

# The harness's own tests run gloo ranks on the CPU on every host, GPU hosts included (a
# one-GPU host could not place two ranks otherwise). GPU paths are checked by the device
# script, never by these tests.
os.environ[DEVICE_ENV_VAR] = "cpu"
# DeepSpeed would pick CUDA wherever a GPU is visible, for the imports tests make themselves.
os.environ["DS_ACCELERATOR"] = "cpu"
