"""The notebook shipped with the package runs top to bottom (nbclient, a fresh kernel), from
another directory than its own."""

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from seqpack.tools import notebook  # noqa: E402

NOTEBOOK = str(notebook())  # shipped with the package


def test_packing_metrics_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("text/html" in o.get("data", {}) for o in outputs)  # the report's tables
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the figure
