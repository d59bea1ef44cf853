"""lossd.v1: the gRPC stubs of proto/lossd/v1/lossd.proto, generated when the package is built:
``from lossd.v1 import lossd_pb2, lossd_pb2_grpc`` (they need the grpcio and protobuf modules;
``import lossd`` alone does not)."""
