# streamapp worker image, built from the repository root by docker compose (docker-compose.yml):
#   GPU (default): TensorRT 10 + CUDA from NVIDIA's container, streamapp[gpu] on top;
#   CPU (profile cpu): --build-arg BASE_IMAGE=python:3.11-slim --build-arg EXTRAS= gives
#   streamapp with ONNX Runtime only.
ARG BASE_IMAGE=nvcr.io/nvidia/tensorrt:24.12-py3
FROM ${BASE_IMAGE}
ARG EXTRAS=gpu

WORKDIR /opt/streamapp
COPY pyproject.toml README.md ./
COPY streamapp ./streamapp
COPY engines ./engines
RUN python -m pip install --no-cache-dir ".${EXTRAS:+[$EXTRAS]}"

ENV STREAMAPP_WEB_BIND=0.0.0.0 \
    PYTHONUNBUFFERED=1
EXPOSE 6066
ENTRYPOINT ["streamapp"]
CMD ["worker"]
