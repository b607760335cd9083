// Compiles the stubs generated for tests/codegen/multi and runs every method
// of their services through a real server, in each of the three stub forms
// (blocking, callback, future).
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "plain.rdmarpc.pb.h"
#include "rdmarpc/rdmarpc.h"
#include "rdmarpc_test/common/types.rdmarpc.pb.h"
#include "rdmarpc_test/outer/inner/services.rdmarpc.pb.h"

namespace {

namespace inner = ::rdmarpc_test::outer::inner;
using ::rdmarpc_test::common::Blob;
using Ints = std::vector<int32_t>;

static_assert(std::string_view(inner::TensorOps::kServiceName) ==
              "rdmarpc_test.outer.inner.TensorOps");
static_assert(std::string_view(inner::Catalog::kServiceName) ==
              "rdmarpc_test.outer.inner.Catalog");
static_assert(std::string_view(::PlainEcho::kServiceName) == "PlainEcho");

// Binds an owned int32 tensor holding `values` to `field`. Owned, because a
// server's response tensors outlive its handler.
rdmarpc::Status SetInts(rdmarpc::CallTensors* tensors, rdmarpc::Tensor* field,
                        const Ints& values) {
  RDMARPC_ASSIGN_OR_RETURN(
      rdmarpc::TensorBuffer buffer,
      rdmarpc::TensorBuffer::Allocate(values.size() * sizeof(int32_t)));
  std::memcpy(buffer.data(), values.data(), buffer.size());
  return tensors->Set(field, rdmarpc::DTYPE_I32,
                      {static_cast<int64_t>(values.size())}, std::move(buffer));
}

// The elements of the int32 host tensor in `field`.
rdmarpc::StatusOr<Ints> GetInts(const rdmarpc::CallTensors& tensors,
                                const rdmarpc::Tensor& field) {
  RDMARPC_ASSIGN_OR_RETURN(rdmarpc::TensorView view, tensors.Get(field));
  if (view.dtype() != rdmarpc::DTYPE_I32 || !view.device().is_host() ||
      view.shape().size() != 1 ||
      view.size() != static_cast<size_t>(view.shape()[0]) * sizeof(int32_t)) {
    return absl::InvalidArgumentError("want a 1-d int32 host tensor");
  }
  Ints values(view.size() / sizeof(int32_t));
  std::memcpy(values.data(), view.data(), view.size());
  return values;
}

class TensorOpsImpl final : public inner::TensorOps::Service {
 public:
  rdmarpc::Status Concat(rdmarpc::ServerContext* ctx,
                         const inner::ConcatRequest& request,
                         inner::ConcatResponse* response) override {
    Ints joined;
    for (const rdmarpc::Tensor& part : request.parts()) {
      RDMARPC_ASSIGN_OR_RETURN(Ints values, GetInts(ctx->tensors(), part));
      joined.insert(joined.end(), values.begin(), values.end());
    }
    response->set_count(request.parts_size());
    return SetInts(&ctx->tensors(), response->mutable_joined(), joined);
  }

  rdmarpc::Status Split(rdmarpc::ServerContext* ctx,
                        const inner::Batch::Item& request,
                        inner::Batch* response) override {
    RDMARPC_ASSIGN_OR_RETURN(Ints values,
                             GetInts(ctx->tensors(), request.values()));
    // All items first: tensors are bound by address (see rdmarpc/tensor.h).
    for (size_t i = 0; i < values.size(); ++i) {
      inner::Batch::Item* item = response->add_items();
      if (request.has_label()) {
        item->set_label(request.label() + "/" + std::to_string(i));
      }
    }
    for (size_t i = 0; i < values.size(); ++i) {
      RDMARPC_RETURN_IF_ERROR(SetInts(
          &ctx->tensors(),
          response->mutable_items(static_cast<int>(i))->mutable_values(),
          {values[i]}));
    }
    response->mutable_summary()->set_name(request.label());
    return SetInts(&ctx->tensors(),
                   response->mutable_summary()->mutable_tensor(), values);
  }
  // Reserved stays unimplemented.
};

class CatalogImpl final : public inner::Catalog::Service {
 public:
  rdmarpc::Status Describe(rdmarpc::ServerContext* ctx, const Blob& request,
                           Blob* response) override {
    RDMARPC_ASSIGN_OR_RETURN(Ints values,
                             GetInts(ctx->tensors(), request.tensor()));
    std::reverse(values.begin(), values.end());
    std::string name = request.name();
    std::transform(name.begin(), name.end(), name.begin(),
                   [](unsigned char c) { return std::toupper(c); });
    response->set_name(name);
    return SetInts(&ctx->tensors(), response->mutable_tensor(), values);
  }

  rdmarpc::Status Merge(rdmarpc::ServerContext* ctx,
                        const inner::Batch& request,
                        inner::Batch::Item* response) override {
    Ints joined;
    for (const inner::Batch::Item& item : request.items()) {
      RDMARPC_ASSIGN_OR_RETURN(Ints values,
                               GetInts(ctx->tensors(), item.values()));
      joined.insert(joined.end(), values.begin(), values.end());
    }
    RDMARPC_ASSIGN_OR_RETURN(
        Ints summary, GetInts(ctx->tensors(), request.summary().tensor()));
    joined.insert(joined.end(), summary.begin(), summary.end());
    response->set_label(request.summary().name());
    return SetInts(&ctx->tensors(), response->mutable_values(), joined);
  }
};

class PlainEchoImpl final : public ::PlainEcho::Service {
 public:
  rdmarpc::Status Echo(rdmarpc::ServerContext* ctx,
                       const ::PlainRequest& request,
                       ::PlainResponse* response) override {
    RDMARPC_ASSIGN_OR_RETURN(Ints values,
                             GetInts(ctx->tensors(), request.data()));
    response->set_text(request.text());
    return SetInts(&ctx->tensors(), response->mutable_data(), values);
  }
};

enum class Form { kBlocking, kCallback, kFuture };

// Makes a call in `form` with the matching stub method.
template <typename Blocking, typename WithCallback, typename Future>
rdmarpc::Status CallIn(Form form, Blocking blocking, WithCallback with_callback,
                       Future future) {
  switch (form) {
    case Form::kBlocking:
      return blocking();
    case Form::kCallback: {
      // Shared with the callback, which may still be returning when get()
      // does. A second run of `done` would throw from set_value.
      auto done = std::make_shared<std::promise<rdmarpc::Status>>();
      std::future<rdmarpc::Status> result = done->get_future();
      with_callback([done](rdmarpc::Status status) {
        done->set_value(std::move(status));
      });
      return result.get();
    }
    case Form::kFuture:
      return future().get();
  }
  return absl::InternalError("unknown form");
}

// stub->Method(ctx, request, response) in the form under test.
#define CALL_IN_FORM(stub, Method, ctx, request, response)                \
  CallIn(                                                                 \
      GetParam(), [&] { return (stub)->Method(ctx, request, response); }, \
      [&](std::function<void(rdmarpc::Status)> done) {                    \
        (stub)->Method(ctx, request, response, std::move(done));          \
      },                                                                  \
      [&] { return (stub)->Method##Future(ctx, request, response); })

class MultiTest : public ::testing::TestWithParam<Form> {
 protected:
  void SetUp() override {
    int port = 0;
    rdmarpc::StatusOr<std::unique_ptr<rdmarpc::Server>> server =
        rdmarpc::ServerBuilder()
            .AddListeningPort("127.0.0.1:0", &port)
            .RegisterService(&tensor_ops_)
            .RegisterService(&catalog_)
            .RegisterService(&plain_)
            .BuildAndStart();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    ASSERT_NE(port, 0);
    channel_ = rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port));
    ctx_.set_timeout(std::chrono::seconds(30));
  }

  void TearDown() override {
    if (server_ != nullptr) server_->Shutdown();
  }

  // The services outlive the server, which is declared after them.
  TensorOpsImpl tensor_ops_;
  CatalogImpl catalog_;
  PlainEchoImpl plain_;
  std::unique_ptr<rdmarpc::Server> server_;
  std::shared_ptr<rdmarpc::Channel> channel_;
  rdmarpc::ClientContext ctx_;  // one call per test
};

TEST_P(MultiTest, ConcatSendsRepeatedTensors) {
  const std::vector<Ints> parts = {
      {1, -2, 3}, {INT32_MAX, INT32_MIN}, {0x5a5a5a5a}};
  inner::ConcatRequest request;
  for (size_t i = 0; i < parts.size(); ++i) request.add_parts();
  for (size_t i = 0; i < parts.size(); ++i) {
    ASSERT_TRUE(SetInts(&ctx_.tensors(),
                        request.mutable_parts(static_cast<int>(i)), parts[i])
                    .ok());
  }
  inner::ConcatResponse response;
  auto stub = inner::TensorOps::NewStub(channel_);

  rdmarpc::Status status =
      CALL_IN_FORM(stub, Concat, &ctx_, request, &response);

  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(response.count(), 3u);
  rdmarpc::StatusOr<Ints> joined = GetInts(ctx_.tensors(), response.joined());
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_EQ(*joined, (Ints{1, -2, 3, INT32_MAX, INT32_MIN, 0x5a5a5a5a}));
}

TEST_P(MultiTest, SplitReturnsTensorsInRepeatedSubMessages) {
  inner::Batch::Item request;
  request.set_label("x");
  ASSERT_TRUE(
      SetInts(&ctx_.tensors(), request.mutable_values(), {7, -8, 9}).ok());
  inner::Batch response;
  auto stub = inner::TensorOps::NewStub(channel_);

  rdmarpc::Status status = CALL_IN_FORM(stub, Split, &ctx_, request, &response);

  ASSERT_TRUE(status.ok()) << status;
  ASSERT_EQ(response.items_size(), 3);
  const Ints expected = {7, -8, 9};
  for (int i = 0; i < response.items_size(); ++i) {
    const inner::Batch::Item& item = response.items(i);
    ASSERT_TRUE(item.has_label());
    EXPECT_EQ(item.label(), "x/" + std::to_string(i));
    rdmarpc::StatusOr<Ints> values = GetInts(ctx_.tensors(), item.values());
    ASSERT_TRUE(values.ok()) << values.status();
    EXPECT_EQ(*values, Ints{expected[i]});
  }
  EXPECT_EQ(response.summary().name(), "x");
  rdmarpc::StatusOr<Ints> summary =
      GetInts(ctx_.tensors(), response.summary().tensor());
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(*summary, expected);
}

TEST_P(MultiTest, MethodNotOverriddenIsUnimplemented) {
  inner::ConcatRequest request;
  inner::ConcatResponse response;
  auto stub = inner::TensorOps::NewStub(channel_);

  rdmarpc::Status status =
      CALL_IN_FORM(stub, Reserved, &ctx_, request, &response);

  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented) << status;
  EXPECT_NE(
      status.message().find("/rdmarpc_test.outer.inner.TensorOps/Reserved"),
      std::string_view::npos)
      << status;
}

TEST_P(MultiTest, DescribeUsesMessagesFromAnotherPackage) {
  Blob request;
  request.set_name("weights");
  ASSERT_TRUE(
      SetInts(&ctx_.tensors(), request.mutable_tensor(), {1, 2, 3, 4}).ok());
  Blob response;
  auto stub = inner::Catalog::NewStub(channel_);

  rdmarpc::Status status =
      CALL_IN_FORM(stub, Describe, &ctx_, request, &response);

  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(response.name(), "WEIGHTS");
  rdmarpc::StatusOr<Ints> values = GetInts(ctx_.tensors(), response.tensor());
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (Ints{4, 3, 2, 1}));
}

TEST_P(MultiTest, MergeSendsTensorsInRepeatedAndNestedSubMessages) {
  const std::vector<Ints> items = {{10, 11}, {-12}, {13, 14, 15}};
  inner::Batch request;
  for (size_t i = 0; i < items.size(); ++i) request.add_items();
  for (size_t i = 0; i < items.size(); ++i) {
    ASSERT_TRUE(
        SetInts(&ctx_.tensors(),
                request.mutable_items(static_cast<int>(i))->mutable_values(),
                items[i])
            .ok());
  }
  request.mutable_summary()->set_name("all");
  ASSERT_TRUE(SetInts(&ctx_.tensors(),
                      request.mutable_summary()->mutable_tensor(), {99})
                  .ok());
  inner::Batch::Item response;
  auto stub = inner::Catalog::NewStub(channel_);

  rdmarpc::Status status = CALL_IN_FORM(stub, Merge, &ctx_, request, &response);

  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(response.label(), "all");
  rdmarpc::StatusOr<Ints> values = GetInts(ctx_.tensors(), response.values());
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (Ints{10, 11, -12, 13, 14, 15, 99}));
}

TEST_P(MultiTest, Proto2ServiceWithoutPackage) {
  ::PlainRequest request;
  request.set_text("plain");
  ASSERT_TRUE(
      SetInts(&ctx_.tensors(), request.mutable_data(), {-1, 0, 1}).ok());
  ::PlainResponse response;
  auto stub = ::PlainEcho::NewStub(channel_);

  rdmarpc::Status status = CALL_IN_FORM(stub, Echo, &ctx_, request, &response);

  ASSERT_TRUE(status.ok()) << status;
  EXPECT_EQ(response.text(), "plain");
  rdmarpc::StatusOr<Ints> values = GetInts(ctx_.tensors(), response.data());
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (Ints{-1, 0, 1}));
}

INSTANTIATE_TEST_SUITE_P(AllForms, MultiTest,
                         ::testing::Values(Form::kBlocking, Form::kCallback,
                                           Form::kFuture),
                         [](const ::testing::TestParamInfo<Form>& info) {
                           switch (info.param) {
                             case Form::kBlocking:
                               return "Blocking";
                             case Form::kCallback:
                               return "Callback";
                             case Form::kFuture:
                               return "Future";
                           }
                           return "Unknown";
                         });

TEST(GeneratedServiceTest, RegistersEveryMethodWithItsPathAndTypes) {
  TensorOpsImpl service;
  const std::vector<rdmarpc::MethodDescriptor>& methods = service.methods();
  ASSERT_EQ(methods.size(), 3u);
  EXPECT_EQ(methods[0].path, "/rdmarpc_test.outer.inner.TensorOps/Concat");
  EXPECT_EQ(methods[1].path, "/rdmarpc_test.outer.inner.TensorOps/Split");
  EXPECT_EQ(methods[2].path, "/rdmarpc_test.outer.inner.TensorOps/Reserved");
  EXPECT_EQ(methods[1].request_prototype->GetDescriptor()->full_name(),
            "rdmarpc_test.outer.inner.Batch.Item");
  EXPECT_EQ(methods[1].response_prototype->GetDescriptor()->full_name(),
            "rdmarpc_test.outer.inner.Batch");
  EXPECT_EQ(::PlainEcho::Service().methods().at(0).path, "/PlainEcho/Echo");
}

// Client code under test: takes the generated StubInterface, so a test can
// hand it a mock instead of a stub connected to a server.
std::string Shout(PlainEcho::StubInterface* stub, const std::string& text) {
  rdmarpc::ClientContext ctx;
  PlainRequest req;
  req.set_text(text);
  PlainResponse resp;
  rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
  return s.ok() ? resp.text() + "!" : std::string(s.message());
}

class MockPlainEchoStub : public PlainEcho::StubInterface {
 public:
  MOCK_METHOD(rdmarpc::Status, Echo,
              (rdmarpc::ClientContext*, const PlainRequest&, PlainResponse*),
              (override));
  MOCK_METHOD(void, Echo,
              (rdmarpc::ClientContext*, const PlainRequest&, PlainResponse*,
               std::function<void(rdmarpc::Status)>),
              (override));
  MOCK_METHOD(std::future<rdmarpc::Status>, EchoFuture,
              (rdmarpc::ClientContext*, const PlainRequest&, PlainResponse*),
              (override));
};

TEST(MockedStubTest, ClientCodeRunsAgainstAMockedStubInterface) {
  MockPlainEchoStub stub;
  EXPECT_CALL(stub, Echo(testing::_, testing::_, testing::_))
      .WillOnce([](rdmarpc::ClientContext*, const PlainRequest& req,
                   PlainResponse* resp) {
        resp->set_text(req.text() + req.text());
        return absl::OkStatus();
      })
      .WillOnce(testing::Return(absl::UnavailableError("no server")));
  EXPECT_EQ(Shout(&stub, "hey"), "heyhey!");
  EXPECT_EQ(Shout(&stub, "hey"), "no server");
}

// A channel that answers every call itself, recording the method.
class FakeChannel final : public rdmarpc::ChannelInterface {
 public:
  void CallAsync(std::string_view method, rdmarpc::ClientContext*,
                 const google::protobuf::Message& request,
                 google::protobuf::Message* response,
                 std::function<void(rdmarpc::Status)> done) override {
    methods.emplace_back(method);
    const auto& req = static_cast<const PlainRequest&>(request);
    static_cast<PlainResponse*>(response)->set_text("fake:" + req.text());
    done(absl::OkStatus());
  }
  rdmarpc::Status Call(std::string_view method, rdmarpc::ClientContext* ctx,
                       const google::protobuf::Message& request,
                       google::protobuf::Message* response) override {
    return CallFuture(method, ctx, request, response).get();
  }
  std::future<rdmarpc::Status> CallFuture(
      std::string_view method, rdmarpc::ClientContext* ctx,
      const google::protobuf::Message& request,
      google::protobuf::Message* response) override {
    std::promise<rdmarpc::Status> done;
    CallAsync(method, ctx, request, response,
              [&done](rdmarpc::Status s) { done.set_value(std::move(s)); });
    return done.get_future();
  }
  std::vector<std::string> methods;
};

TEST(MockedStubTest, GeneratedStubRunsOverAFakeChannel) {
  auto channel = std::make_shared<FakeChannel>();
  auto stub = PlainEcho::NewStub(channel);
  EXPECT_EQ(Shout(stub.get(), "hi"), "fake:hi!");
  rdmarpc::ClientContext ctx;
  PlainRequest req;
  req.set_text("cb");
  PlainResponse resp;
  int runs = 0;
  stub->Echo(&ctx, req, &resp, [&runs](rdmarpc::Status s) {
    EXPECT_TRUE(s.ok());
    ++runs;
  });
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(resp.text(), "fake:cb");
  EXPECT_EQ(channel->methods,
            (std::vector<std::string>{"/PlainEcho/Echo", "/PlainEcho/Echo"}));
}

}  // namespace
