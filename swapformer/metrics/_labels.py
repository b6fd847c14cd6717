"""What the label metrics accuracy.py and f1.py share. When `evaluate.load` loads one of them by path it
copies this file beside it (a relative import is a local dependency to evaluate), so the import works
there as it does inside the package."""

import datasets
import evaluate


def label_metric_info(description: str, inputs_description: str) -> evaluate.MetricInfo:
    """The MetricInfo of a metric over class labels: one int `predictions` and one int `references` per
    example."""
    return evaluate.MetricInfo(
        description=description,
        citation="",
        inputs_description=inputs_description,
        features=datasets.Features(
            {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
        ),
    )
