"""Generated protobuf and gRPC stubs for package ``kvserve.v1`` (see ``kvserve.protogen``)."""
