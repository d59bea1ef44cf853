// The names a server lists in ServerInfo.features (docs/api.md, "Server
// features"), written once for the server that fills them and the client
// that checks them. They are wire values: never rename one.
#ifndef LOSSD_COMMON_SERVER_FEATURES_H_
#define LOSSD_COMMON_SERVER_FEATURES_H_

namespace lossd {

// Distillation, policy losses and segments in Forward, LinearForward and
// Evaluate (on the stream and in data-connection frames).
inline constexpr char kFeaturePostTraining[] = "post_training";
inline constexpr char kFeatureLinearForward[] = "linear_forward";
// Evaluate over hidden states against a stored head (EvaluateHeader.weight).
inline constexpr char kFeatureEvaluateHiddenStates[] = "evaluate_hidden_states";
// Evaluate's row blocks over data connections (EvaluateHeader.data_token).
inline constexpr char kFeatureEvaluateDataConnections[] =
    "evaluate_data_connections";

// Every feature this build serves, in the order ServerInfo lists them.
inline constexpr const char* kServedFeatures[] = {
    kFeaturePostTraining, kFeatureLinearForward, kFeatureEvaluateHiddenStates,
    kFeatureEvaluateDataConnections};

}  // namespace lossd

#endif  // LOSSD_COMMON_SERVER_FEATURES_H_
