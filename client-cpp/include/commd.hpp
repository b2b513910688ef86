// commd.hpp: header-only C++17 wrapper over the commd C API (commd.h).
//
//   commd::Session session;                          // $COMMD_SOCKET or the default socket
//   commd::UniqueId id = session.unique_id();        // on rank 0; pass id.bytes() to every rank
//   commd::Communicator comm = session.communicator(id, rank, nranks);
//   commd::Buffer buf = session.alloc_array<float>(n);
//   std::fill_n(buf.as<float>(), n, 1.0f);
//   comm.all_reduce<float>(buf, buf, n, commd::RedOp::Sum);          // blocking, in place
//   commd::Request r = comm.all_reduce_async<float>(buf, buf, n, commd::RedOp::Sum);
//   r.wait();                                                        // throws on failure
//
// Failures throw commd::Error subclasses (MismatchError, PeerLostError, TimeoutError, ...), whose
// what() is the daemon's message (it names the communicator, the op and the ranks involved).
//
// Ownership rule (as for NCCL and nonblocking MPI): until a Request completes, do not read or
// write what its op writes, nor write what it reads. Destroying a Request without waiting is
// allowed (the op still runs; its result is discarded), and destroying a Buffer under an
// in-flight op is memory-safe but loses that op's data.
//
// Every object is move-only and owns one C handle; Communicators and Buffers keep their Session
// alive inside the library, so they may outlive the Session object.
#ifndef COMMD_HPP
#define COMMD_HPP

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "commd.h"

namespace commd {

// ---------------------------------------------------------------------------------------------
// Errors

/// Base of every commd exception: a status code and the library's message.
class Error : public std::runtime_error {
 public:
  Error(commd_status_t status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  /// The C status code (COMMD_MISMATCH, ...).
  commd_status_t status() const noexcept { return status_; }
  /// The status code's name ("COMMD_MISMATCH").
  const char* status_name() const noexcept { return commd_status_name(status_); }

 private:
  commd_status_t status_;
};

/// A NULL handle, unknown dtype/reduction, a buffer range outside its allocation, a bad rank...
class InvalidArgumentError : public Error {
  using Error::Error;
};
/// No daemon answers at the socket; what() names the path.
class DaemonUnavailableError : public Error {
  using Error::Error;
};
/// The daemon exited or closed this session.
class DaemonLostError : public Error {
  using Error::Error;
};
/// Ranks posted different ops at the same position; the communicator stays usable.
class MismatchError : public Error {
  using Error::Error;
};
/// Another rank died or left; the communicator is aborted.
class PeerLostError : public Error {
  using Error::Error;
};
/// An op or a join did not complete in time; what() names the missing ranks.
class TimeoutError : public Error {
  using Error::Error;
};
/// The daemon is shutting down.
class ShutdownError : public Error {
  using Error::Error;
};
/// The op was aborted because its communicator was aborted earlier.
class AbortedError : public Error {
  using Error::Error;
};
/// A rank revoked the communicator (what() names it and why).
class RevokedError : public AbortedError {
  using AbortedError::AbortedError;
};
/// A bug in commd; please report what().
class InternalError : public Error {
  using Error::Error;
};

namespace detail {

[[noreturn]] inline void throw_status(commd_status_t s) {
  std::string m = commd_last_error();
  if (m.empty()) m = commd_status_name(s);
  switch (s) {
    case COMMD_INVALID_ARGUMENT: throw InvalidArgumentError(s, m);
    case COMMD_DAEMON_UNAVAILABLE: throw DaemonUnavailableError(s, m);
    case COMMD_DAEMON_LOST: throw DaemonLostError(s, m);
    case COMMD_MISMATCH: throw MismatchError(s, m);
    case COMMD_PEER_LOST: throw PeerLostError(s, m);
    case COMMD_TIMEOUT: throw TimeoutError(s, m);
    case COMMD_SHUTDOWN: throw ShutdownError(s, m);
    case COMMD_ABORTED: throw AbortedError(s, m);
    case COMMD_REVOKED: throw RevokedError(s, m);
    case COMMD_INTERNAL: throw InternalError(s, m);
    default: throw Error(s, m);
  }
}

/// Throws for anything but COMMD_OK.
inline void check(commd_status_t s) {
  if (s != COMMD_OK) throw_status(s);
}

/// COMMD_OK: true; COMMD_IN_PROGRESS: false; else throws.
inline bool check_done(commd_status_t s) {
  if (s == COMMD_OK) return true;
  if (s == COMMD_IN_PROGRESS) return false;
  throw_status(s);
}

/// Whole milliseconds to wait for `d`, rounded up: 0 for a zero, negative or NaN duration,
/// UINT64_MAX (no limit) past what 64 bits hold. Computed in double, so a duration near its
/// type's maximum (seconds::max()) or an infinite one does not overflow as ceil<milliseconds>
/// would.
template <class Rep, class Period>
std::uint64_t wait_ms(std::chrono::duration<Rep, Period> d) noexcept {
  const double ms = std::chrono::duration<double, std::milli>(d).count();
  if (!(ms > 0)) return 0;
  if (ms >= 18446744073709549568.0) return UINT64_MAX;  // the largest double below 2^64
  return static_cast<std::uint64_t>(std::ceil(ms));
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Element types and reductions

enum class DType : commd_dtype_t {
  Float32 = COMMD_FLOAT32,
  Float64 = COMMD_FLOAT64,
  Float16 = COMMD_FLOAT16,
  BFloat16 = COMMD_BFLOAT16,
  Int8 = COMMD_INT8,
  UInt8 = COMMD_UINT8,
  Int32 = COMMD_INT32,
  Int64 = COMMD_INT64,
  UInt32 = COMMD_UINT32,
  UInt64 = COMMD_UINT64,
  Float8E4M3 = COMMD_FLOAT8E4M3,  ///< fp8, accumulated in float32, stored saturated
  Float8E5M2 = COMMD_FLOAT8E5M2,  ///< fp8, accumulated in float32, stored saturated
};

enum class RedOp : commd_redop_t {
  Sum = COMMD_SUM,
  Prod = COMMD_PROD,
  Min = COMMD_MIN,
  Max = COMMD_MAX,
  Avg = COMMD_AVG,
  BitAnd = COMMD_BAND,  ///< integer dtypes only
  BitOr = COMMD_BOR,    ///< integer dtypes only
  BitXor = COMMD_BXOR,  ///< integer dtypes only
};

/// Bytes per element (0 for a value that is not a known DType).
inline std::size_t dtype_size(DType d) noexcept {
  return commd_dtype_size(static_cast<commd_dtype_t>(d));
}

/// IEEE half-precision storage (the bits only; convert with your own half type).
struct float16 {
  std::uint16_t bits;
};
/// bfloat16 storage (the upper 16 bits of a float32).
struct bfloat16 {
  std::uint16_t bits;
};
/// fp8 E4M3 storage (the code only).
struct float8_e4m3 {
  std::uint8_t bits;
};
/// fp8 E5M2 storage (the code only).
struct float8_e5m2 {
  std::uint8_t bits;
};

/// dtype_of<T>::value: the DType of a C++ element type (float, double, int8_t, uint8_t, int32_t,
/// int64_t, uint32_t, uint64_t, commd::float16, commd::bfloat16, commd::float8_e4m3,
/// commd::float8_e5m2). Specialize it for your own 16-bit or 8-bit float types.
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> : std::integral_constant<DType, DType::Float32> {};
template <>
struct dtype_of<double> : std::integral_constant<DType, DType::Float64> {};
template <>
struct dtype_of<float16> : std::integral_constant<DType, DType::Float16> {};
template <>
struct dtype_of<bfloat16> : std::integral_constant<DType, DType::BFloat16> {};
template <>
struct dtype_of<std::int8_t> : std::integral_constant<DType, DType::Int8> {};
template <>
struct dtype_of<std::uint8_t> : std::integral_constant<DType, DType::UInt8> {};
template <>
struct dtype_of<std::int32_t> : std::integral_constant<DType, DType::Int32> {};
template <>
struct dtype_of<std::int64_t> : std::integral_constant<DType, DType::Int64> {};
template <>
struct dtype_of<std::uint32_t> : std::integral_constant<DType, DType::UInt32> {};
template <>
struct dtype_of<std::uint64_t> : std::integral_constant<DType, DType::UInt64> {};
template <>
struct dtype_of<float8_e4m3> : std::integral_constant<DType, DType::Float8E4M3> {};
template <>
struct dtype_of<float8_e5m2> : std::integral_constant<DType, DType::Float8E5M2> {};

template <class T>
inline constexpr DType dtype_v = dtype_of<std::remove_cv_t<T>>::value;

// ---------------------------------------------------------------------------------------------
// Unique ids

/// Names a communicator being created: 128 plain bytes, made by rank 0, given to every rank.
class UniqueId {
 public:
  static constexpr std::size_t size = COMMD_UNIQUE_ID_BYTES;

  UniqueId() noexcept { std::memset(&raw_, 0, sizeof raw_); }
  explicit UniqueId(const commd_unique_id_t& raw) noexcept : raw_(raw) {}

  const std::uint8_t* bytes() const noexcept { return raw_.bytes; }
  std::uint8_t* bytes() noexcept { return raw_.bytes; }
  const commd_unique_id_t& raw() const noexcept { return raw_; }

  /// Lowercase hex (256 characters), e.g. for a command line or an environment variable.
  std::string to_hex() const {
    static const char digits[] = "0123456789abcdef";
    std::string s;
    s.reserve(2 * size);
    for (std::uint8_t b : raw_.bytes) {
      s.push_back(digits[b >> 4]);
      s.push_back(digits[b & 15]);
    }
    return s;
  }

  /// Parses to_hex()'s output; throws InvalidArgumentError on anything else.
  static UniqueId from_hex(std::string_view hex) {
    if (hex.size() != 2 * size) {
      throw InvalidArgumentError(COMMD_INVALID_ARGUMENT,
                                 "commd::UniqueId::from_hex: expected " +
                                     std::to_string(2 * size) + " hex digits, got " +
                                     std::to_string(hex.size()));
    }
    auto nibble = [](char c) -> int {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      return -1;
    };
    UniqueId id;
    for (std::size_t i = 0; i < size; i++) {
      int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
      if (hi < 0 || lo < 0) {
        throw InvalidArgumentError(COMMD_INVALID_ARGUMENT,
                                   "commd::UniqueId::from_hex: not a hex digit near position " +
                                       std::to_string(2 * i));
      }
      id.raw_.bytes[i] = static_cast<std::uint8_t>(hi << 4 | lo);
    }
    return id;
  }

 private:
  commd_unique_id_t raw_;
};

// ---------------------------------------------------------------------------------------------
// Buffers

class Buffer;

/// A location in a buffer: (buffer, byte offset). A Buffer converts to At{buffer, 0}; a
/// default-constructed At is "no buffer" (recv of reduce on non-roots, send of broadcast on
/// non-roots).
struct At {
  const commd_buffer_t* buffer = nullptr;
  std::uint64_t offset = 0;

  At() = default;
  At(const Buffer& b);  // NOLINT(google-explicit-constructor): a buffer is its start
  At(const Buffer& b, std::uint64_t byte_offset);
};

/// Host memory shared with the daemon (zero-filled, page-aligned). Move-only.
class Buffer {
 public:
  Buffer() = default;
  /// Adopts a handle from commd_buffer_alloc.
  explicit Buffer(commd_buffer_t* handle) noexcept : h_(handle) {}
  Buffer(Buffer&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      commd_buffer_free(h_);
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { commd_buffer_free(h_); }

  void* data() const noexcept { return commd_buffer_data(h_); }
  /// Size in bytes.
  std::size_t size() const noexcept { return static_cast<std::size_t>(commd_buffer_size(h_)); }
  /// The memory as an array of T.
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(data());
  }
  /// How many whole T fit.
  template <class T>
  std::size_t count() const noexcept {
    return size() / sizeof(T);
  }
  /// (this buffer, byte offset), for ops.
  At at(std::uint64_t byte_offset) const noexcept { return At(*this, byte_offset); }
  /// (this buffer, offset of element `index` of type T); throws InvalidArgumentError when
  /// the byte offset does not fit in 64 bits (it would wrap to another element).
  template <class T>
  At at_elem(std::uint64_t index) const {
    if (index > UINT64_MAX / sizeof(T)) {
      throw InvalidArgumentError(COMMD_INVALID_ARGUMENT,
                                 "commd::Buffer::at_elem: element " + std::to_string(index) +
                                     " of " + std::to_string(sizeof(T)) +
                                     " bytes is past any offset");
    }
    return At(*this, index * sizeof(T));
  }

  commd_buffer_t* get() const noexcept { return h_; }
  explicit operator bool() const noexcept { return h_ != nullptr; }

 private:
  commd_buffer_t* h_ = nullptr;
};

inline At::At(const Buffer& b) : buffer(b.get()), offset(0) {}
inline At::At(const Buffer& b, std::uint64_t byte_offset) : buffer(b.get()), offset(byte_offset) {}

// ---------------------------------------------------------------------------------------------
// Requests

/// A posted op. Move-only; destroying it unwaited is allowed (see the ownership rule above).
class [[nodiscard]] Request {
 public:
  Request() = default;
  /// Adopts a handle returned by a commd_* op.
  explicit Request(commd_request_t* handle) noexcept : h_(handle) {}
  Request(Request&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  Request& operator=(Request&& o) noexcept {
    if (this != &o) {
      commd_request_free(h_);
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() { commd_request_free(h_); }

  /// Blocks until the op completes; throws its error (again on every later call).
  void wait() { detail::check(commd_request_wait(h_)); }

  /// Waits at most `timeout`: true if the op completed, false if it is still running.
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> timeout) {
    return detail::check_done(commd_request_wait_timeout(h_, detail::wait_ms(timeout)));
  }

  /// Whether the op completed, without blocking (throws if it failed).
  bool test() { return detail::check_done(commd_request_test(h_)); }

  commd_request_t* get() const noexcept { return h_; }
  explicit operator bool() const noexcept { return h_ != nullptr; }

 private:
  commd_request_t* h_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Communicators

/// This process's rank in a communicator. Move-only; destroying it leaves the communicator
/// (the other ranks' later ops fail with PeerLostError).
///
/// Each op has a blocking form (returns when done, throws on failure) and an _async form that
/// returns a Request. The typed forms take the DType from the template argument:
/// comm.all_reduce<float>(send, recv, n, RedOp::Sum). Counts are in elements, as in NCCL.
class Communicator {
 public:
  Communicator() = default;
  /// Adopts a handle from commd_comm_init.
  explicit Communicator(commd_comm_t* handle) noexcept : h_(handle) {}
  Communicator(Communicator&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  Communicator& operator=(Communicator&& o) noexcept {
    if (this != &o) {
      commd_comm_destroy(h_);
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  ~Communicator() { commd_comm_destroy(h_); }

  std::uint32_t rank() const {
    std::uint32_t r = 0;
    detail::check(commd_comm_rank(h_, &r));
    return r;
  }
  std::uint32_t size() const {
    std::uint32_t n = 0;
    detail::check(commd_comm_size(h_, &n));
    return n;
  }
  /// Caps the daemon's GPU copies for this communicator at bytes_per_sec (0: uncapped), for
  /// every rank on this node (see commd_comm_set_pacing).
  void set_pacing(std::uint64_t bytes_per_sec) const {
    detail::check(commd_comm_set_pacing(h_, bytes_per_sec));
  }

  // All-reduce: recv (count elements) = reduction over ranks of send.
  Request all_reduce_async(At send, At recv, std::size_t count, DType t, RedOp op) const {
    return post([&](commd_request_t** r) {
      return commd_all_reduce(h_, send.buffer, send.offset, recv.buffer, recv.offset, count,
                              code(t), code(op), r);
    });
  }
  void all_reduce(At send, At recv, std::size_t count, DType t, RedOp op) const {
    check(commd_all_reduce(h_, send.buffer, send.offset, recv.buffer, recv.offset, count, code(t),
                           code(op), nullptr));
  }

  // Reduce to root: root's recv (count elements) = reduction of send; recv may be At{}
  // elsewhere.
  Request reduce_async(At send, At recv, std::size_t count, DType t, RedOp op,
                       std::uint32_t root) const {
    return post([&](commd_request_t** r) {
      return commd_reduce(h_, send.buffer, send.offset, recv.buffer, recv.offset, count, code(t),
                          code(op), root, r);
    });
  }
  void reduce(At send, At recv, std::size_t count, DType t, RedOp op, std::uint32_t root) const {
    check(commd_reduce(h_, send.buffer, send.offset, recv.buffer, recv.offset, count, code(t),
                       code(op), root, nullptr));
  }

  // Reduce-scatter: send holds recv_count * size() elements; recv gets this rank's block.
  Request reduce_scatter_async(At send, At recv, std::size_t recv_count, DType t,
                               RedOp op) const {
    return post([&](commd_request_t** r) {
      return commd_reduce_scatter(h_, send.buffer, send.offset, recv.buffer, recv.offset,
                                  recv_count, code(t), code(op), r);
    });
  }
  void reduce_scatter(At send, At recv, std::size_t recv_count, DType t, RedOp op) const {
    check(commd_reduce_scatter(h_, send.buffer, send.offset, recv.buffer, recv.offset, recv_count,
                               code(t), code(op), nullptr));
  }

  // All-gather: recv gets send_count * size() elements, rank r's at block r.
  Request all_gather_async(At send, At recv, std::size_t send_count, DType t) const {
    return post([&](commd_request_t** r) {
      return commd_all_gather(h_, send.buffer, send.offset, recv.buffer, recv.offset, send_count,
                              code(t), r);
    });
  }
  void all_gather(At send, At recv, std::size_t send_count, DType t) const {
    check(commd_all_gather(h_, send.buffer, send.offset, recv.buffer, recv.offset, send_count,
                           code(t), nullptr));
  }

  // Broadcast count elements from root's send to every recv; send may be At{} off root.
  Request broadcast_async(At send, At recv, std::size_t count, DType t,
                          std::uint32_t root) const {
    return post([&](commd_request_t** r) {
      return commd_broadcast(h_, send.buffer, send.offset, recv.buffer, recv.offset, count,
                             code(t), root, r);
    });
  }
  void broadcast(At send, At recv, std::size_t count, DType t, std::uint32_t root) const {
    check(commd_broadcast(h_, send.buffer, send.offset, recv.buffer, recv.offset, count, code(t),
                          root, nullptr));
  }

  // All-to-all: block p (count_per_peer elements) of send goes to rank p.
  Request all_to_all_async(At send, At recv, std::size_t count_per_peer, DType t) const {
    return post([&](commd_request_t** r) {
      return commd_all_to_all(h_, send.buffer, send.offset, recv.buffer, recv.offset,
                              count_per_peer, code(t), r);
    });
  }
  void all_to_all(At send, At recv, std::size_t count_per_peer, DType t) const {
    check(commd_all_to_all(h_, send.buffer, send.offset, recv.buffer, recv.offset, count_per_peer,
                           code(t), nullptr));
  }

  // Point to point: count elements to/from rank peer.
  Request send_async(At buf, std::size_t count, DType t, std::uint32_t peer) const {
    return post([&](commd_request_t** r) {
      return commd_send(h_, buf.buffer, buf.offset, count, code(t), peer, r);
    });
  }
  void send(At buf, std::size_t count, DType t, std::uint32_t peer) const {
    check(commd_send(h_, buf.buffer, buf.offset, count, code(t), peer, nullptr));
  }
  Request recv_async(At buf, std::size_t count, DType t, std::uint32_t peer) const {
    return post([&](commd_request_t** r) {
      return commd_recv(h_, buf.buffer, buf.offset, count, code(t), peer, r);
    });
  }
  void recv(At buf, std::size_t count, DType t, std::uint32_t peer) const {
    check(commd_recv(h_, buf.buffer, buf.offset, count, code(t), peer, nullptr));
  }

  Request barrier_async() const {
    return post([&](commd_request_t** r) { return commd_barrier(h_, r); });
  }
  void barrier() const { check(commd_barrier(h_, nullptr)); }

  // Typed forms: the DType comes from T.
  template <class T>
  void all_reduce(At send, At recv, std::size_t count, RedOp op) const {
    all_reduce(send, recv, count, dtype_v<T>, op);
  }
  template <class T>
  Request all_reduce_async(At send, At recv, std::size_t count, RedOp op) const {
    return all_reduce_async(send, recv, count, dtype_v<T>, op);
  }
  template <class T>
  void reduce(At send, At recv, std::size_t count, RedOp op, std::uint32_t root) const {
    reduce(send, recv, count, dtype_v<T>, op, root);
  }
  template <class T>
  void reduce_scatter(At send, At recv, std::size_t recv_count, RedOp op) const {
    reduce_scatter(send, recv, recv_count, dtype_v<T>, op);
  }
  template <class T>
  void all_gather(At send, At recv, std::size_t send_count) const {
    all_gather(send, recv, send_count, dtype_v<T>);
  }
  template <class T>
  void broadcast(At send, At recv, std::size_t count, std::uint32_t root) const {
    broadcast(send, recv, count, dtype_v<T>, root);
  }
  template <class T>
  void all_to_all(At send, At recv, std::size_t count_per_peer) const {
    all_to_all(send, recv, count_per_peer, dtype_v<T>);
  }
  template <class T>
  Request send_async(At buf, std::size_t count, std::uint32_t peer) const {
    return send_async(buf, count, dtype_v<T>, peer);
  }
  template <class T>
  Request recv_async(At buf, std::size_t count, std::uint32_t peer) const {
    return recv_async(buf, count, dtype_v<T>, peer);
  }
  template <class T>
  void send(At buf, std::size_t count, std::uint32_t peer) const {
    send(buf, count, dtype_v<T>, peer);
  }
  template <class T>
  void recv(At buf, std::size_t count, std::uint32_t peer) const {
    recv(buf, count, dtype_v<T>, peer);
  }

  commd_comm_t* get() const noexcept { return h_; }
  explicit operator bool() const noexcept { return h_ != nullptr; }

 private:
  static commd_dtype_t code(DType t) noexcept { return static_cast<commd_dtype_t>(t); }
  static commd_redop_t code(RedOp o) noexcept { return static_cast<commd_redop_t>(o); }
  static void check(commd_status_t s) { detail::check(s); }
  template <class F>
  static Request post(F&& f) {
    commd_request_t* r = nullptr;
    detail::check(f(&r));
    return Request(r);
  }

  commd_comm_t* h_ = nullptr;
};

// ---------------------------------------------------------------------------------------------
// Sessions

/// A session with the local daemon. Move-only.
class Session {
 public:
  /// Connects to the daemon at `socket_path` (nullptr or "": $COMMD_SOCKET, else the default
  /// socket). Throws DaemonUnavailableError (naming the path) if none answers.
  explicit Session(const char* socket_path = nullptr) {
    detail::check(commd_session_open(socket_path, &h_));
  }
  explicit Session(const std::string& socket_path) : Session(socket_path.c_str()) {}
  Session(Session&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  Session& operator=(Session&& o) noexcept {
    if (this != &o) {
      commd_session_close(h_);
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  ~Session() { commd_session_close(h_); }

  /// A fresh communicator id (on one rank; share its bytes with the others).
  UniqueId unique_id() const {
    commd_unique_id_t raw;
    detail::check(commd_get_unique_id(h_, &raw));
    return UniqueId(raw);
  }

  /// Joins communicator `id` as `rank` of `nranks`; returns when all ranks joined. A zero
  /// timeout means the daemon's default (op_timeout_ms / join timeout).
  Communicator communicator(const UniqueId& id, std::uint32_t rank, std::uint32_t nranks,
                            std::chrono::milliseconds op_timeout = std::chrono::milliseconds(0),
                            std::chrono::milliseconds join_timeout =
                                std::chrono::milliseconds(0)) const {
    commd_comm_t* c = nullptr;
    detail::check(commd_comm_init(h_, &id.raw(), rank, nranks, ms(op_timeout), ms(join_timeout),
                                  &c));
    return Communicator(c);
  }

  /// `bytes` of shared memory registered with the daemon (zero-filled).
  Buffer alloc(std::size_t bytes) const {
    commd_buffer_t* b = nullptr;
    detail::check(commd_buffer_alloc(h_, bytes, &b));
    return Buffer(b);
  }
  /// Room for `count` elements of T.
  template <class T>
  Buffer alloc_array(std::size_t count) const {
    if (count > SIZE_MAX / sizeof(T)) {
      throw InvalidArgumentError(COMMD_INVALID_ARGUMENT,
                                 "commd::Session::alloc_array: " + std::to_string(count) +
                                     " elements of " + std::to_string(sizeof(T)) +
                                     " bytes overflow size_t");
    }
    return alloc(count * sizeof(T));
  }

  commd_session_t* get() const noexcept { return h_; }

 private:
  static std::uint64_t ms(std::chrono::milliseconds d) noexcept {
    return d.count() > 0 ? static_cast<std::uint64_t>(d.count()) : 0;
  }
  commd_session_t* h_ = nullptr;
};

/// The library's version ("MAJOR.MINOR.PATCH").
inline const char* version() noexcept { return commd_version(); }

}  // namespace commd

#endif  // COMMD_HPP
