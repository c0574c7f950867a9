"""The former path of :mod:`infer.foundation.validation`, kept so that code written against it
(and the structure check's "a light import stays light" probe) still imports."""

from infer.foundation.validation import *  # noqa: F401,F403
