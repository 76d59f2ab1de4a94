"""rayturn.protos."""

# Dotted path of the function that registers a RayTurn servicer on a grpc.Server,
# in the form Ray Serve's gRPC options take it.
SERVICER_FUNCTION = "rayturn.protos.rayturn_pb2_grpc.add_RayTurnServicer_to_server"
