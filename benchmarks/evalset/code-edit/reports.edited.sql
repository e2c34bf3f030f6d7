-- Monthly reports for the cycling club's ride log (SQLite).

-- Distance per member this month, longest first.
SELECT m.name,
       COUNT(r.id) AS rides,
       ROUND(SUM(r.distance_km), 1) AS total_km,
       ROUND(AVG(r.avg_speed_kmh), 1) AS avg_speed
FROM members m
JOIN rides r ON r.member_id = m.id
WHERE r.started_at >= DATE('now', 'start of month')
GROUP BY m.id
HAVING COUNT(r.id) > 0
ORDER BY total_km DESC;

-- Members with no ride in the last 60 days.
SELECT m.name, MAX(r.started_at) AS last_ride
FROM members m
LEFT JOIN rides r ON r.member_id = m.id
GROUP BY m.id
HAVING last_ride IS NULL
    OR last_ride < DATE('now', '-60 days')
ORDER BY last_ride;

-- Routes ridden by at least three members, with their best times.
SELECT rt.name AS route,
       COUNT(DISTINCT r.member_id) AS riders,
       MIN(r.duration_min) AS best_minutes
FROM routes rt
JOIN rides r ON r.route_id = rt.id
GROUP BY rt.id
HAVING COUNT(DISTINCT r.member_id) >= 3
ORDER BY riders DESC, best_minutes ASC
LIMIT 10;

-- Weekly climbing totals for one member (parameter :member).
SELECT STRFTIME('%Y-%W', r.started_at) AS week,
       SUM(r.elevation_m) AS climbed_m,
       CASE
           WHEN SUM(r.elevation_m) >= 3000 THEN 'mountain goat'
           WHEN SUM(r.elevation_m) >= 1000 THEN 'hill lover'
           ELSE 'flatlander'
       END AS badge
FROM rides r
WHERE r.member_id = :member
GROUP BY week
ORDER BY week DESC;

-- Club records: the longest single ride of each member, ties kept.
SELECT m.name, r.distance_km, r.started_at
FROM rides r
JOIN members m ON m.id = r.member_id
WHERE r.distance_km = (
    SELECT MAX(r2.distance_km) FROM rides r2 WHERE r2.member_id = r.member_id
)
ORDER BY r.distance_km DESC;
