// A striped upload's stripe as the server works with it, apart from the
// validation of the wire message (validation.h): the assembly
// (striped_uploads.h) needs the one without protobuf types.
#ifndef LOSSD_SERVER_STRIPE_SPEC_H_
#define LOSSD_SERVER_STRIPE_SPEC_H_

#include <string>

namespace lossd {

// A striped upload's stripe, checked (ValidateUploadStripe, validation.h).
struct StripeSpec {
  std::string upload_id;
  int index = 0;
  int count = 1;
};

}  // namespace lossd

#endif  // LOSSD_SERVER_STRIPE_SPEC_H_
