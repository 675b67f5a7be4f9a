"""The remote-code files (`configuration_dspark.REMOTE_CODE_FILES`) as a package.

They live at the repository root because they are copied next to every checkpoint, and they import each other as
siblings (`from .configuration_dspark import ...`), so they need a parent package. A wheel ships them here (see
`setup.py`); a source checkout or editable install serves them from the repository root.
"""

import os

_repository_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not os.path.isfile(os.path.join(os.path.dirname(__file__), "modeling_dspark.py")) and os.path.isfile(
    os.path.join(_repository_root, "modeling_dspark.py")
):
    __path__.append(_repository_root)
